"""benchmarks/attention/_sage_o_cosine.py: Q, K, V captured from a model's own layers, and Sage's O against fp32 on them."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from benchmarks.attention import sage_fidelity
from benchmarks.attention._sage_o_cosine import Capture, capture_attention_inputs, o_cosine, o_cosine_target, spread_layers
from neutrain.attention import accuracy_metrics, exact_attention


def _tiny_model(layers: int = 3):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=96, max_position_embeddings=128)  # head dim 64: Sage's
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()


def test_captured_inputs_are_the_layers_own_and_the_model_is_left_as_it_was():
    model = _tiny_model()
    ids = torch.randint(0, 96, (2, 64), generator=torch.Generator().manual_seed(1))
    before = model(input_ids=ids).logits

    captures = capture_attention_inputs(model, [ids, ids[:1]], [0, 2])

    assert [c.layer for c in captures] == [0, 2, 0, 2]
    assert captures[0].q.shape == (2, 2, 64, 64) and captures[0].k.shape == (2, 1, 64, 64)
    assert all(c.causal and c.scale == 64 ** -0.5 for c in captures)
    # Exact fp32 attention on the captured inputs is the output the layer computed: the capture is faithful.
    for c in captures:
        exact = exact_attention(c.q, c.k, c.v, causal=c.causal, scale=c.scale).transpose(1, 2)
        assert accuracy_metrics(exact, c.out)["cos"] > 0.999999
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(model(input_ids=ids).logits, before)


def _random_captures(layers=(0, 1), calls=2) -> list[Capture]:
    gen = torch.Generator().manual_seed(2)
    out = []
    for _ in range(calls):
        for layer in layers:
            q, k, v = (torch.randn(1, h, 128, 64, generator=gen) for h in (4, 2, 2))
            out.append(Capture(layer, q, k, v, 64 ** -0.5, True))
    return out


def test_o_cosine_reports_each_layer_and_plain_pv_is_not_closer_to_fp32_than_with_the_residual():
    report = o_cosine(_random_captures(), backend="reference")

    assert set(report["layers"]) == {"0", "1"} and report["backend"] == "reference" and report["gate"] == 0.999
    for layer in report["layers"].values():
        for setting in ("v_residual", "plain"):
            stats = layer[setting]
            assert stats["calls"] == 2 and 0.99 < stats["min"] <= stats["median"] <= 1.0, layer
        # V's residual removes most of V's FP8 rounding: on zero-mean random V plain PV is farther from fp32.
        assert layer["plain"]["min"] < layer["v_residual"]["min"], layer
    assert report["min"]["plain"] == min(v["plain"]["min"] for v in report["layers"].values())


def test_the_o_cosine_target_is_the_smallest_cosine_of_either_setting():
    report = {"layers": {"0": {}}, "min": {"v_residual": 0.9995, "plain": 0.9985}}
    target = o_cosine_target(report)
    assert target["value"] == 0.9985 and target["goal"] == ">= 0.999" and target["met"] is False
    assert o_cosine_target({"layers": {"0": {}}, "min": {"v_residual": 0.9996, "plain": 0.9992}})["met"] is True
    assert o_cosine_target(None)["value"] is None and o_cosine_target(None)["met"] is None
    assert sage_fidelity.attention_targets(report)["sage_o_cosine_min"]["value"] == 0.9985


def test_spread_layers_takes_the_first_middle_and_last():
    assert spread_layers(30) == [0, 14, 29] and spread_layers(2) == [0, 1] and spread_layers(1) == [0]
