"""Speculative generate with ``engine=True``: static caches give the same exact decoding.

The ``DynamicCache`` path is checked exactly in ``test_generate.py`` (MarkovLM enumeration and
chi-square; its greedy and EOS tests run both paths). Here the engine path (static KV caches, tree
verification over a column mask, accepted path moved in place, K draft rows in one batch-K cache)
must draw the same samples as the dynamic path from the same seed at T > 0 for every scheme, and
follow the target's sequence law (chi-square) on its own.
"""

import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from neutrain.speculative import generate
from tests.unit.speculative.test_generate import chi_square, chi_square_threshold


def tiny_llama(seed, layers=2, hidden=64, vocab=48, sharpen=1.0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None,
        bos_token_id=None, pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():  # tiny random models are near uniform; sharpen so target and draft differ
        model.lm_head.weight.mul_(sharpen)
    return model


CONFIGS = [  # (draft models, K, scheme, target temperature, draft temperature)
    (1, 1, "sd", 1.0, 1.0),
    (1, 2, "specinfer", 1.0, 1.0),
    (1, 3, "spectr", 1.0, 1.0),
    (1, 2, "importance", 0.8, 1.3),
    (2, 2, "specinfer", 1.0, 1.0),
]


def _models(n_drafts, vocab=48, sharpen=1.0):
    target = tiny_llama(0, vocab=vocab, sharpen=sharpen)
    drafts = [tiny_llama(1 + i, layers=1, hidden=32, vocab=vocab, sharpen=sharpen) for i in range(n_drafts)]
    return target, drafts[0] if n_drafts == 1 else drafts


@pytest.mark.parametrize("n_drafts,k,scheme,temp,draft_temp", CONFIGS)
def test_engine_draws_the_same_samples_as_the_dynamic_cache(n_drafts, k, scheme, temp, draft_temp):
    target, draft = _models(n_drafts, sharpen=6.0)
    prompt = torch.tensor([[4, 9, 33, 2]])
    accepted = 0
    for seed in range(4):
        runs = [generate(target, draft, prompt, num_drafts=k, draft_len=3, scheme=scheme, temperature=temp,
                         draft_temperature=draft_temp, max_new_tokens=20, generator=torch.Generator().manual_seed(seed),
                         engine=engine) for engine in (False, True)]
        assert torch.equal(runs[0].sequences, runs[1].sequences), seed
        assert runs[0].stats.as_dict() == runs[1].stats.as_dict()
        accepted += runs[1].stats.accepted_positions
    assert accepted > 0  # drafts were accepted, so cache compaction and row selection were exercised


def _sequence_probs(model, prompt, steps, temperature):
    vocab = model.config.vocab_size
    conts = list(itertools.product(range(vocab), repeat=steps))
    ids = torch.tensor([prompt + list(c) for c in conts])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.double() / temperature, -1)
    n = len(prompt)
    out = {}
    for row, cont in enumerate(conts):
        out[cont] = float(sum(logp[row, n - 1 + t, tok] for t, tok in enumerate(cont)).exp())
    return out


@pytest.mark.parametrize("n_drafts,k,scheme", [(1, 2, "importance"), (2, 2, "specinfer")])
def test_engine_sequences_follow_the_target_chi_square(n_drafts, k, scheme):
    target, draft = _models(n_drafts, vocab=4, sharpen=30.0)
    prompt, steps, n = [1, 2], 3, 500
    gen = torch.Generator().manual_seed(1234)
    counts = {}
    for _ in range(n):
        out = generate(target, draft, torch.tensor([prompt]), num_drafts=k, draft_len=2, scheme=scheme,
                       temperature=1.0, max_new_tokens=steps, generator=gen, engine=True)
        key = tuple(out.sequences[0, len(prompt):].tolist())
        counts[key] = counts.get(key, 0) + 1
    stat, dof = chi_square(counts, _sequence_probs(target, prompt, steps, 1.0), n)
    assert stat < chi_square_threshold(dof), (stat, dof)
    first = draft if n_drafts == 1 else draft[0]
    wrong, wrong_dof = chi_square(counts, _sequence_probs(first, prompt, steps, 1.0), n)
    assert wrong > 3 * chi_square_threshold(wrong_dof)  # the test tells the target's law from the draft's
