"""Diagnosis measures: key spectrum, adjacent-layer cosine, needle token positions, prefill states."""

import math

import pytest
import torch

from eval_helpers import tiny_llama
from neutrain.eval.kv.diagnose import (
    adjacent_layer_cosine,
    key_spectrum,
    needle_token_positions,
    prefill_states,
    spectrum_energy,
)
from neutrain.eval.tasks import char_tokenizer


def test_spectrum_energy_of_a_known_rank():
    torch.manual_seed(0)
    x = torch.randn(50, 3) @ torch.randn(3, 12)  # rank 3
    e = spectrum_energy(x, ranks=(1, 2, 3, 64))
    assert e[1] < e[2] < e[3] and e[3] == pytest.approx(1.0) and e[64] == pytest.approx(1.0)
    s = torch.linalg.svdvals(x.double())
    assert e[1] == pytest.approx(float(s[0] ** 2 / (s**2).sum()), rel=1e-6)


def test_prefill_states_pre_rope_keys_are_k_proj_outputs():
    """RoPE inverted on the cached keys gives back k_proj's output (the keys ShadowKV factorises)."""
    model = tiny_llama(layers=2)
    ids = torch.randint(0, 97, (1, 30))
    seen = {}
    hook = model.model.layers[1].self_attn.k_proj.register_forward_hook(lambda m, a, out: seen.setdefault("k", out))
    try:
        states = prefill_states(model, ids)
    finally:
        hook.remove()
    expected = seen["k"].view(1, 30, 2, 16).transpose(1, 2)
    torch.testing.assert_close(states["pre_rope_keys"][1], expected, atol=1e-4, rtol=1e-4)
    assert (states["keys"][1] - expected).abs().max() > 1e-2  # RoPE did move the cached keys
    spectrum = key_spectrum(states["pre_rope_keys"], ranks=(1, 32))
    assert len(spectrum) == 2 and spectrum[0][1] < spectrum[0][32] == pytest.approx(1.0)
    cos = adjacent_layer_cosine(states["values"])
    assert len(cos) == 1 and -1.0 <= cos[0] < 0.99


def test_adjacent_cosine_is_per_token_over_heads():
    a = torch.zeros(1, 2, 2, 2)
    a[0, 0, 0, 0] = a[0, 1, 1, 1] = 1.0  # token 0 on head 0, token 1 on head 1
    b = a.clone()
    b[0, 1, 1, 1] = -1.0  # token 1 flipped: cosines +1 and -1
    assert adjacent_layer_cosine([a, b]) == [0.0]


def test_needle_positions_cover_exactly_the_needle():
    tok = char_tokenizer()
    prompt = "hay hay 4711 hay"
    assert needle_token_positions(tok, prompt, "4711") == [8, 9, 10, 11]
    with pytest.raises(ValueError, match="not in the prompt"):
        needle_token_positions(tok, prompt, "999")


@pytest.mark.slow
def test_merge_plan_merges_only_the_similar_pair_of_a_tiny_model():
    """A 6-layer Llama whose layer 3 repeats layer 2 (same K/V projections, layer 2 adds nothing to the
    residual stream): the plan merges pair (2, 3) only, and MiniCache with its threshold does the same."""
    import transformers

    from neutrain import compat
    from neutrain.eval.kv import MiniCache
    from neutrain.eval.kv.diagnose import model_merge_plan

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=50)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    layers = model.model.layers
    with torch.no_grad():
        layers[2].self_attn.o_proj.weight.zero_()
        layers[2].mlp.down_proj.weight.zero_()
        for name in ("k_proj", "v_proj"):
            getattr(layers[3].self_attn, name).weight.copy_(getattr(layers[2].self_attn, name).weight)
        layers[3].input_layernorm.weight.copy_(layers[2].input_layernorm.weight)
    calibration = [torch.randint(0, 50, (1, 40)) for _ in range(2)]
    plan = model_merge_plan(model, calibration, start_layer=2)
    assert [p["layers"] for p in plan["pairs"]] == [[2, 3], [4, 5]]
    assert plan["merged_pairs"] == [[2, 3]] and plan["pairs"][0]["restore_error"] < 1e-6
    assert plan["pairs"][1]["restore_error"] > plan["tolerance"] and plan["pairs"][1]["similarity"] < plan["min_similarity"]
    kwarg = compat.cache_forward_kwarg(model)
    cache = MiniCache(model.config, start_layer=2, gamma=0.0, merge_every=None, min_similarity=plan["min_similarity"] - 1e-4)
    with torch.no_grad():
        model(torch.randint(0, 50, (1, 30)), use_cache=True, **{kwarg: cache})
    assert cache.merges == 1 and cache.unmerged_pairs == 1
    assert cache.layers[2].role == "first" and cache.layers[4].role == "exact"
    dense = MiniCache(model.config, start_layer=2, gamma=0.0, merge_every=None)  # guard: without it both merge
    with torch.no_grad():
        model(torch.randint(0, 50, (1, 30)), use_cache=True, **{kwarg: dense})
    assert dense.merges == 2


def test_merge_plan_with_no_similar_pair_merges_nothing_on_other_prompts():
    """Near-orthogonal adjacent layers (SmolLM2, the retrieval model): no pair is within the tolerance, and
    the threshold must keep every pair exact on other prompts too. A threshold just above the calibration
    pairs' highest cosine (noise around 0) is crossed by other prompts' noise, and those pairs merge."""
    from neutrain.eval.kv import MiniCache
    from neutrain.eval.kv.diagnose import merge_plan
    from neutrain.eval.kv.minicache import mean_direction_cosine

    torch.manual_seed(0)
    draw = lambda: [torch.randn(1, 2, 64, 8) for _ in range(8)]  # noqa: E731 - 4 pairs from layer 0
    keys, values = draw(), draw()
    plan = merge_plan(keys, values, start_layer=0)
    assert plan["merged_pairs"] == [] and not any(p["within_tolerance"] for p in plan["pairs"])
    model = tiny_llama(layers=8)
    merged, crossing = 0, 0
    for _ in range(25):  # other prompts: fresh draws of the same near-orthogonal states
        k, v = draw(), draw()
        for first in range(0, 8, 2):
            similarity = min(mean_direction_cosine(k[first], k[first + 1]), mean_direction_cosine(v[first], v[first + 1]))
            crossing += similarity >= plan["min_similarity"]
        cache = MiniCache(model.config, start_layer=0, merge_every=None, min_similarity=plan["min_similarity"])
        for layer in range(8):
            cache.update(k[layer], v[layer], layer)
        merged += cache.merges
    assert crossing == 0 and merged == 0
    from neutrain.eval.kv.diagnose import tolerance_similarity

    assert plan["min_similarity"] == round(tolerance_similarity(0.6, 0.1), 6)  # about 0.86


def test_tolerance_similarity_is_where_the_restore_error_meets_the_tolerance():
    """At the returned cosine, the worse layer of a merged pair loses exactly ``tolerance`` (no retention)."""
    from neutrain.eval.kv.diagnose import merge_restore_error, tolerance_similarity

    for t, tol in ((0.6, 0.1), (0.3, 0.05), (0.5, 0.2)):
        c = tolerance_similarity(t, tol)
        u = torch.randn(1, 1, 1, 16)
        u = u / u.norm()
        w = torch.randn(1, 1, 1, 16)
        w = w - (w * u).sum() * u
        w = w / w.norm()
        other = c * u + math.sqrt(1 - c * c) * w  # cosine c with u
        assert abs(merge_restore_error(u, 2.0 * other, t) - tol) < 1e-4
