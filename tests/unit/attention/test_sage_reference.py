"""Accuracy of the quantized SageAttention math (pure-PyTorch reference, the CPU path)
against exact fp32 attention, with bf16 SDPA's own error reported as the floor."""

import pytest
import torch
import torch.nn.functional as F

from neutrain.attention import counters, exact_attention, reset_counters, sage_attention
from neutrain.attention.quant import TILE, quantize_attention_inputs
from neutrain.attention.reference import accuracy_metrics, make_attention_inputs


def _bf16_sdpa_floor(q, k, v, causal):
    groups = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        q.bfloat16(), k.bfloat16().repeat_interleave(groups, 1), v.bfloat16().repeat_interleave(groups, 1),
        is_causal=causal)
    return accuracy_metrics(out, exact_attention(q, k, v, causal))


def _run(q, k, v, causal, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = sage_attention(q, k, v, causal=causal, backend="reference", **kw)
    grad = torch.randn_like(out)
    out.backward(grad)
    qe, ke, ve = (t.detach().clone().requires_grad_() for t in (q, k, v))
    exact = exact_attention(qe, ke, ve, causal)
    exact.backward(grad)
    grads = [accuracy_metrics(a.grad, b.grad) for a, b in ((q, qe), (k, ke), (v, ve))]
    return accuracy_metrics(out, exact), grads


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_gradients_match_exact_attention(head_dim, causal, record_property):
    reset_counters()
    q, k, v = make_attention_inputs(1, 4, 2, 200, head_dim, "random", torch.float32)
    out_m, grad_m = _run(q, k, v, causal)
    floor = _bf16_sdpa_floor(q, k, v, causal)
    record_property("sage_vs_fp32", out_m)
    record_property("bf16_sdpa_vs_fp32_floor", floor)
    print(f"d={head_dim} causal={causal} sage {out_m} | bf16 SDPA floor {floor}")
    assert counters["reference"] == 1 and counters["reference_backward"] == 1
    assert counters["fallback"] == 0
    assert out_m["finite"] and out_m["cos"] >= 0.999 and out_m["rel_l1"] <= 0.03
    for name, m in zip("qkv", grad_m):
        assert m["finite"] and m["cos"] >= 0.998, (name, m)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["k_offset", "sink", "heavy_q"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_outlier_suite(kind, head_dim):
    reset_counters()
    q, k, v = make_attention_inputs(1, 2, 2, 160, head_dim, kind, torch.float32)
    out_m, grad_m = _run(q, k, v, causal=True)
    print(kind, head_dim, out_m, [round(m["cos"], 5) for m in grad_m], "floor", _bf16_sdpa_floor(q, k, v, True))
    assert counters["fallback"] == 0 and counters["reference"] == 1
    assert out_m["cos"] >= 0.995
    assert all(m["cos"] >= 0.99 for m in grad_m), grad_m


@pytest.mark.slow
def test_plain_sa2_without_v_residual_is_less_accurate_but_close():
    q, k, v = make_attention_inputs(1, 2, 2, 256, 64, "random", torch.float32)
    plain, _ = _run(q, k, v, False, v_residual=False)
    default, _ = _run(q, k, v, False)
    assert plain["cos"] >= 0.999 and plain["rel_l1"] > default["rel_l1"]


@pytest.mark.slow
def test_int4_simulation_and_q_smoothing():
    reset_counters()
    q, k, v = make_attention_inputs(1, 2, 1, 144, 64, "random", torch.float32)
    q = q + 3.0 * torch.randn(64)  # a shared Q offset is what Q smoothing removes
    int8, _ = _run(q, k, v, True)
    int4, _ = _run(q, k, v, True, qk_bits=4)
    int4_smooth, _ = _run(q, k, v, True, qk_bits=4, smooth_q=True)
    assert counters["fallback"] == 0 and counters["reference"] == 3
    assert int4["cos"] < int8["cos"]  # 15 levels instead of 255 must cost accuracy
    assert int4_smooth["cos"] > int4["cos"]
    assert int4_smooth["cos"] >= 0.9  # INT4 is inherently coarse (SA2-4b costs ~4% ppl)


def test_quantizers_round_trip_and_smooth_k_is_exact():
    q, k, v = make_attention_inputs(2, 2, 1, 100, 64, "k_offset", torch.float32)
    qi = quantize_attention_inputs(q, k, v, 0.125)
    assert qi.q_int.shape[2] == TILE and qi.q_int.dtype == torch.int8
    assert int(qi.q_int.abs().max()) == 127 and int(qi.k_int[:, :, 100:].abs().max()) == 0
    k_hat = qi.k_int.float() * qi.k_scale[..., None] + qi.k_mean
    assert accuracy_metrics(k_hat[:, :, :100], k)["rel_l2"] < 0.01
    v_hat = (qi.v_fp8_t.float() + qi.v_residual_t.float() / 16) * qi.v_scale[..., None]
    assert accuracy_metrics(v_hat.transpose(2, 3)[:, :, :100], v)["rel_l2"] < 0.005
    # Smoothing K changes every score row by a constant only.
    s = q @ k.transpose(-1, -2)
    s_smooth = q @ (k - qi.k_mean).transpose(-1, -2)
    assert torch.allclose(torch.softmax(s, -1), torch.softmax(s_smooth, -1), atol=1e-5)


def test_unsupported_head_dim_falls_back_to_sdpa_and_counts():
    reset_counters()
    q, k, v = make_attention_inputs(1, 2, 2, 16, 32, "random", torch.float32)
    out = sage_attention(q, k, v, causal=True)
    assert counters["fallback"] == 1 and counters["fallback:head_dim=32"] == 1
    assert accuracy_metrics(out, exact_attention(q, k, v, True))["cos"] > 0.9999
