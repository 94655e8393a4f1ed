"""A packed row trains as its documents apart: every attention neutrain offers, both loss paths.

Why: Llama's config says ``use_cache``, so a training forward without activation checkpointing (which turns the
cache off) built one, and with a cache transformers skips its packed-sequence check: under ``sdpa`` and ``eager``
each packed document attended to the ones before it in the row (``neutrain_sage`` read the positions itself and
did not). The chunked loss's forward now runs without a cache.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from neutrain.attention.packed import register as register_packed
from neutrain.config import MemorySection
from neutrain.nn.linear_cross_entropy import causal_lm_loss
from neutrain.trainer import NeuTrainer
from tests.helpers import TINY_LLAMA

LENGTHS = (10, 14, 5)


def _model(attn: str):
    config = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}, vocab_size=64)
    assert config.use_cache  # the default that caused it
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float64)
    model.config._attn_implementation = attn
    return model.train()


def _row():
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (1, sum(LENGTHS)))
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    labels = ids.clone()
    for start in torch.cumsum(torch.tensor(LENGTHS), 0)[:-1]:
        labels[0, start] = -100  # no document predicts the next one's first token
    return ids, labels, positions


def _apart(model, ids, labels):
    """The documents' mean loss, each forward on its own."""
    total, count, start = 0.0, 0, 0
    for n in LENGTHS:
        targets = int((labels[0, start + 1:start + n] != -100).sum())
        total = total + causal_lm_loss(model, ids[:, start:start + n], labels[:, start:start + n]) * targets
        count, start = count + targets, start + n
    return total / count


@pytest.mark.parametrize("attn", ["sdpa", "eager", "neutrain_sdpa"])
def test_the_chunked_loss_of_a_packed_row_is_its_documents_apart(attn):
    if attn == "neutrain_sdpa":
        register_packed()
    model = _model(attn)
    ids, labels, positions = _row()
    packed = causal_lm_loss(model, ids, labels, position_ids=positions)
    torch.testing.assert_close(packed, _apart(model, ids, labels))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_trainers_own_loss_of_a_packed_row_is_its_documents_apart(tmp_path, attn):
    """The path a dense run without the chunked loss takes (transformers' Trainer.compute_loss): it built no
    cache before either; kept beside the other so the class stays covered on both."""
    model = _model(attn)
    args = TrainingArguments(str(tmp_path / "out"), use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
    trainer = NeuTrainer(model=model, args=args, memory=MemorySection(loss_chunk_size=0, weights="dense"))
    ids, labels, positions = _row()
    loss = trainer.compute_loss(model, {"input_ids": ids, "labels": labels, "position_ids": positions})
    torch.testing.assert_close(loss, _apart(model, ids, labels))
