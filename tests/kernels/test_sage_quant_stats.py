"""The one-stats-pass SageAttention quantization (``kv_stats`` then tile-sized Q/K/V programs)
against the torch quantizers (CPU: Triton's interpreter, which the conftest turns on).

K's mean comes from another summation order than torch's, so it is compared to a float64
mean within fp32 rounding; everything quantized from it is compared bit for bit with the
torch quantizers fed that same mean. V's scale must equal ``fp8_channel_scale`` exactly.
"""

import pytest
import torch

from neutrain.attention.quant import (
    LOG2E,
    TILE,
    _quantize_cuda,
    fp8_channel_scale,
    quantize_int_per_group,
    quantize_v_fp8_transposed,
    round_up,
)
from neutrain.kernels.sage_quant import _STATS_BLOCK, kv_stats

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(b, hq, hk, n, d, seed, token_major=False):
    """Q, K, V [B, H, N, D] in bf16 with a large shared K offset and a V channel of zeros; with
    ``token_major`` they are transposed views of [B, N, H, D] tensors (HF's layout)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def make(h):
        t = torch.randn((b, n, h, d) if token_major else (b, h, n, d), device=DEVICE, generator=gen)
        return t.to(torch.bfloat16).transpose(1, 2) if token_major else t.to(torch.bfloat16)

    q, k, v = make(hq), make(hk), make(hk)
    # In place, so that the views keep their strides. A heavy offset is smooth-K's case.
    k.add_(16.0 * torch.randn(1, hk, 1, d, device=DEVICE, generator=gen).to(torch.bfloat16))
    v[..., 3] = 0.0
    v[..., 5] *= 1e-3  # a channel whose amax sits far below the others
    return q, k, v


def _check_mean(mean, k):
    exact = k.double().mean(dim=2, keepdim=True)
    # fp32 summation of n terms: relative to the sum of magnitudes, a few n * eps at worst.
    bound = 4 * k.shape[2] * torch.finfo(torch.float32).eps * k.double().abs().mean(dim=2, keepdim=True)
    assert mean.shape == exact.shape and mean.dtype == torch.float32
    assert bool(((mean.double() - exact).abs() <= bound).all()), float(((mean.double() - exact).abs() / bound).max())


# (b, hq, hk, n, d, chunk, token_major): GQA, ragged N (not a multiple of the stats block, the
# chunk or TILE), several splits per head, token-major (non-contiguous) views.
CASES = [
    (1, 2, 2, 150, 64, 64, False),
    (2, 4, 2, 301, 128, 128, True),
    (1, 6, 3, 77, 64, 64, True),
]


@pytest.mark.parametrize("b,hq,hk,n,d,chunk,token_major", CASES)
def test_kv_stats_mean_and_exact_v_scale(b, hq, hk, n, d, chunk, token_major):
    q, k, v = _inputs(b, hq, hk, n, d, seed=n + d, token_major=token_major)
    assert k.is_contiguous() != token_major
    k_mean, v_scale = kv_stats(k, v, chunk=chunk)
    _check_mean(k_mean, k)
    assert torch.equal(v_scale, fp8_channel_scale(v))
    # Deterministic: the same partials in the same order on every run.
    again = kv_stats(k, v, chunk=chunk)
    assert torch.equal(again[0], k_mean) and torch.equal(again[1], v_scale)


@pytest.mark.parametrize("b,hq,hk,n,d,chunk,token_major", CASES)
@pytest.mark.parametrize("k_group", [16, TILE])
def test_one_stats_pass_quantization_is_bit_identical_given_its_mean(b, hq, hk, n, d, chunk, token_major, k_group,
                                                                      monkeypatch):
    """``_quantize_cuda`` (the default, one stats pass) against the torch quantizers given the
    kernel's own K mean: every quantized tensor and scale bit for bit."""
    import neutrain.kernels.sage_quant as sage_quant

    monkeypatch.setattr(sage_quant, "STATS_CHUNK", chunk)  # several splits per head at test sizes
    q, k, v = _inputs(b, hq, hk, n, d, seed=3 * n + d, token_major=token_major)
    n_pad = round_up(n, TILE)
    softmax_scale = d ** -0.5
    got = _quantize_cuda(q, k, v, softmax_scale, 8, 16, k_group, True, n_pad, separate_passes=False)
    _check_mean(got.k_mean, k)

    # The reference on CPU: CUDA's torch divides by a Python float as a multiply by its reciprocal.
    q, k, v, k_mean = q.cpu(), k.cpu(), v.cpu(), got.k_mean.cpu()
    q_int, q_scale = quantize_int_per_group(q, 16, 8, n_pad, softmax_scale * LOG2E)
    k_int, k_scale = quantize_int_per_group(k.float() - k_mean, k_group, 8, n_pad)
    v_t, v_res, v_scale = quantize_v_fp8_transposed(v, n_pad)
    for name, ref in (("q_int", q_int), ("q_scale", q_scale), ("k_int", k_int), ("k_scale", k_scale),
                      ("v_scale", v_scale)):
        assert torch.equal(getattr(got, name).cpu(), ref), name
    # FP8 compared as bits (a value compare would call -0 and +0 equal).
    for name, ref in (("v_fp8_t", v_t), ("v_residual_t", v_res)):
        assert torch.equal(getattr(got, name).cpu().view(torch.uint8), ref.view(torch.uint8)), name
    assert float(got.v_fp8_t[..., n:].float().abs().max()) == 0 and float(got.k_int[:, :, n:].abs().max()) == 0


def test_separate_passes_variant_matches_too():
    """The older launches (torch K mean and V scale, one group per Q/K program) stay selectable
    and give the same Q and V, and K from torch's mean."""
    b, hq, hk, n, d = 1, 2, 1, 140, 64
    q, k, v = _inputs(b, hq, hk, n, d, seed=7)
    n_pad = round_up(n, TILE)
    old = _quantize_cuda(q, k, v, 0.125, 4, 16, 16, False, n_pad, separate_passes=True)
    new = _quantize_cuda(q, k, v, 0.125, 4, 16, 16, False, n_pad, separate_passes=False)
    assert old.v_residual_t is None and new.v_residual_t is None
    for name in ("q_int", "q_scale", "v_scale"):
        assert torch.equal(getattr(old, name), getattr(new, name)), name
    assert torch.equal(old.v_fp8_t.view(torch.uint8), new.v_fp8_t.view(torch.uint8))
    assert torch.equal(old.k_mean, k.mean(dim=2, keepdim=True, dtype=torch.float32))
    k_int, _ = quantize_int_per_group(k.cpu().float() - old.k_mean.cpu(), 16, 4, n_pad)
    assert torch.equal(old.k_int.cpu(), k_int) and int(old.q_int.abs().max()) == 7  # INT4 range


def test_chunk_must_be_a_whole_number_of_stats_blocks():
    k = torch.zeros(1, 1, 8, 64, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple"):
        kv_stats(k, k, chunk=_STATS_BLOCK + 1)
    with pytest.raises(ValueError, match="one shape"):
        kv_stats(k, k[:, :, :4])


def test_smoke_script_times_both_variants(monkeypatch):
    """benchmarks/attention/gluon_sage_smoke.py's quantization timing runs both variants and
    checks that they agree (the timer stubbed: CUDA events need a GPU)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks/attention/gluon_sage_smoke.py"
    spec = importlib.util.spec_from_file_location("gluon_sage_smoke", path)
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    calls = []
    monkeypatch.setattr(smoke, "cuda_time_ms", lambda fn, warmup, iters: (calls.append(fn()), 3.0 - len(calls))[1])
    rec = smoke.time_quant_variants(1, 2, 64, [200], 1, "plain", device=DEVICE)["200"]
    assert (rec["separate_passes"], rec["one_stats_pass"], rec["speedup"]) == (2.0, 1.0, 2.0)
    assert rec["q_v_identical"] is True and rec["k_mean_max_abs_diff"] < 1e-5 and rec["pv"] == "plain"
