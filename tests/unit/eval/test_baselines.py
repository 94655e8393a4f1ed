"""Baselines in the evaluation loop: kvpress presses (pruned prefill) and transformers' QuantizedCache.

The packages are optional; the tests that need them skip without them. The position handling of the
pruned cache and the one-line unavailability errors are tested without them.
"""

import importlib

import pytest
import torch
from transformers import DynamicCache

from eval_helpers import tiny_llama
from neutrain import compat
from neutrain.eval.kv import baselines
from neutrain.eval.kv.baselines import BaselineUnavailable, PrunedCache
from neutrain.eval.loop import greedy_decode


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=2)


def _prune(cache, keep):
    """What a press does after prefill: keep ``keep`` token indices of every layer."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]


@torch.no_grad()
def test_pruned_cache_decodes_at_the_prompts_positions(model):
    """After pruning, the next tokens sit at the unpruned positions: the logits kvpress's pipeline gets by
    passing explicit position_ids equal those of PrunedCache without any."""
    kwarg = compat.cache_forward_kwarg(model)
    ids = torch.randint(0, 97, (1, 50))
    keep = torch.cat([torch.arange(4), torch.arange(30, 50)])  # sink + recent window (StreamingLLM's shape)
    ours, theirs, naive = PrunedCache(config=model.config), DynamicCache(config=model.config), DynamicCache(config=model.config)
    for cache in (ours, theirs, naive):
        model(input_ids=ids, use_cache=True, **{kwarg: cache})
        _prune(cache, keep)
    assert ours.get_seq_length() == 50 and ours.stats()["compression_ratio"] == pytest.approx(50 / 24)
    nxt = torch.randint(0, 97, (1, 3))
    steps = []
    for i in range(3):
        a = model(input_ids=nxt[:, i : i + 1], use_cache=True, **{kwarg: ours}).logits
        b = model(input_ids=nxt[:, i : i + 1], position_ids=torch.tensor([[50 + i]]), use_cache=True,
                  **{kwarg: theirs}).logits
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        steps.append(a)
    # guard: a plain DynamicCache puts the next token at position 24 (its pruned length): other logits
    first = model(input_ids=nxt[:, :1], use_cache=True, **{kwarg: naive}).logits
    assert (first - steps[0]).abs().max() > 1e-4


@pytest.mark.slow
def test_unpruned_pruned_cache_is_dynamic_cache(model):
    ids = torch.randint(0, 97, (2, 40))
    ref = greedy_decode(model, ids, 12, DynamicCache(config=model.config))["tokens"]
    assert torch.equal(greedy_decode(model, ids, 12, PrunedCache(config=model.config))["tokens"], ref)


def test_missing_packages_are_one_line_reasons(monkeypatch, model):
    real = importlib.import_module

    def fake(name, *a, **k):
        if name.startswith(("kvpress", "optimum", "hqq")):
            raise ModuleNotFoundError(f"No module named '{name.split('.')[0]}'")
        return real(name, *a, **k)

    monkeypatch.setattr(baselines.importlib, "import_module", fake)
    with pytest.raises(BaselineUnavailable, match="kvpress SnapKVPress: ModuleNotFoundError") as exc:
        baselines.make_press("snapkv", 0.5)
    assert "\n" not in str(exc.value)
    with pytest.raises(BaselineUnavailable, match="optimum-quanto or hqq") as exc:
        with baselines.quantized_cache_factory(model):
            pass
    assert "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="unknown press"):
        baselines.make_press("h2o", 0.5)


@pytest.mark.parametrize("press", sorted(baselines.PRESSES))
def test_press_off_is_identical_and_on_prunes(model, press):
    pytest.importorskip("kvpress")
    ids = torch.randint(0, 97, (1, 120))
    ref = greedy_decode(model, ids, 10, DynamicCache(config=model.config))["tokens"]
    with baselines.press_cache_factory(model, press, 0.0) as make:
        assert torch.equal(greedy_decode(model, ids, 10, make())["tokens"], ref)
    with baselines.press_cache_factory(model, press, 0.5) as make:
        cache = make()
        greedy_decode(model, ids, 10, cache)
    assert cache.layers[0].keys.shape[-2] == 60 + 9 and cache.get_seq_length() == 129
    assert not any(h for layer in model.model.layers for h in layer.self_attn._forward_hooks.values())


def test_quantized_cache_measures_its_bytes(model):
    pytest.importorskip("optimum.quanto")
    ids = torch.randint(0, 97, (1, 120))
    with baselines.quantized_cache_factory(model, group=32, residual=16) as make:
        cache = make()
        greedy_decode(model, ids, 10, cache)
    stats = cache.stats()
    assert stats["full_bytes"] == 2 * 2 * 2 * 129 * 16 * 4  # layers x (K, V) x heads x tokens x dim x fp32
    assert 3 < stats["compression_ratio"] < 8


def test_portable_unpack_matches_quantos_layout():
    packed = torch.tensor([0b1110_0100, 0b0001_1111], dtype=torch.uint8)
    assert baselines._portable_unpack(packed, 4).tolist() == [0b0100, 0b1111, 0b1110, 0b0001]
    assert baselines._portable_unpack(packed[:1], 2).tolist() == [0, 1, 2, 3]
