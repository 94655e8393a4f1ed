"""NeuTrainer takes the recipe's typed sections; mappings get the schema's defaults."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from neutrain.config import MemorySection, RecipeError, TrainSection
from neutrain.config.schema import SCHEMA
from neutrain.nn import compress_model
from neutrain.nn.checkpoint import MARKER
from neutrain.trainer import NeuTrainer
from tests.helpers import TINY_LLAMA


def _model(dtype=torch.float32):
    config = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}, vocab_size=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype)


def _trainer(tmp_path, model=None, **kwargs):
    args = TrainingArguments(str(tmp_path / "out"), use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
    return NeuTrainer(model=model or _model(), args=args, **kwargs)


def test_no_sections_means_schema_defaults(tmp_path):
    trainer = _trainer(tmp_path)
    assert isinstance(trainer.memory, MemorySection) and isinstance(trainer.train_section, TrainSection)
    assert dict(trainer.memory) == {k: key.default for k, key in SCHEMA["memory"].items()}
    assert trainer.train_section.max_consecutive_nonfinite == SCHEMA["train"]["max_consecutive_nonfinite"].default
    assert not trainer.fused


def test_train_keys_in_memory_still_work(tmp_path):
    """The older form: memory={..., "optimizer": ..., "max_consecutive_nonfinite": ...}."""
    trainer = _trainer(tmp_path, memory={"clip_mode": "global_stale", "optimizer": "lomo", "max_consecutive_nonfinite": 3})
    assert trainer.fused and trainer.memory.clip_mode == "global_stale"
    assert trainer.train_section.optimizer == "lomo" and trainer.train_section.max_consecutive_nonfinite == 3
    opt = trainer.create_optimizer()
    assert type(opt).__name__ == "LOMO" and opt.clip_mode == "global_stale"


def test_typed_sections_are_kept(tmp_path):
    memory, train = MemorySection(stochastic_rounding=False), TrainSection(optimizer="adalomo")
    trainer = _trainer(tmp_path, memory=memory, train=train)
    assert trainer.memory is memory and trainer.train_section is train and trainer.fused


def test_a_misspelt_key_is_one_recipe_error(tmp_path):
    with pytest.raises(RecipeError, match=r"^memory: unknown key 'clip'. Did you mean 'clip_mode'\?$"):
        _trainer(tmp_path, memory={"clip": "per_tensor"})


@pytest.mark.parametrize("memory, recorded", [(None, "neuzip-lossless"), ({"weights": "neuzip-lossless"}, "neuzip-lossless")])
def test_compressed_checkpoint_records_lossless_weights(tmp_path, memory, recorded):
    """memory.weights' schema default is ``dense``; a compressed model's checkpoint still says what it holds.

    Before the sections were typed, the trainer re-declared the default as ``neuzip-lossless`` for this case.
    """
    model = _model(torch.bfloat16)
    compress_model(model, "neuzip-lossless", progress=False)
    trainer = _trainer(tmp_path, model=model, memory=memory, train={"optimizer": "lomo"})
    trainer._save(str(tmp_path / "ckpt"))
    assert json.loads((tmp_path / "ckpt" / MARKER).read_text())["weights"] == recorded
