"""Triton kernels that quantize SageAttention's inputs on the GPU: INT8/INT4 Q and K per
token group, per-channel FP8 V with its rounding residual, in one read of each input.

They are the CUDA twins of the torch quantizers in :mod:`neutrain.attention.quant`, and
produce bit-identical tensors (the tests compare them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from neutrain.kernels.sage_format import FP8_MAX, TILE, V_RESIDUAL_GAIN, fp8_channel_scale

# Triton kernels may read module globals only when they are constexpr.
_FP8_MAX = tl.constexpr(FP8_MAX)
_V_RESIDUAL_GAIN = tl.constexpr(V_RESIDUAL_GAIN)


@triton.jit
def _quant_int_kernel(X, MEAN, X_INT, SCALE, stride_xb, stride_xh, stride_xn, H, N_CTX, N_PAD, fold, qmax,
                      HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, SUBTRACT_MEAN: tl.constexpr):
    """One program per GROUP tokens of one head: symmetric integer quantization (Q or smoothed K)."""
    start = tl.program_id(0) * GROUP
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_n = start + tl.arange(0, GROUP)
    offs_d = tl.arange(0, HEAD_DIM)
    keep = offs_n[:, None] < N_CTX
    x = tl.load(X + b * stride_xb + h * stride_xh + offs_n[:, None] * stride_xn + offs_d[None, :], mask=keep,
                other=0.0).to(tl.float32)
    if SUBTRACT_MEAN:
        x = tl.where(keep, x - tl.load(MEAN + bh * HEAD_DIM + offs_d)[None, :], 0.0)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.max(tl.abs(x), 1), 0), 1e-6), qmax)
    # Round half to even like torch.round: adding 1.5 * 2**23 leaves no fraction bits
    # (|x / scale| <= 127), and the CPU interpreter computes it the same way.
    x_int = (tl.math.div_rn(x, scale) + 12582912.0) - 12582912.0
    x_int = tl.minimum(tl.maximum(x_int, -qmax), qmax)
    tl.store(X_INT + (bh * N_PAD + offs_n[:, None]) * HEAD_DIM + offs_d[None, :], x_int.to(tl.int8))
    tl.store(SCALE + bh * N_PAD + offs_n, tl.zeros([GROUP], tl.float32) + scale * fold)


@triton.jit
def _round_to_e4m3(x):
    """Round fp32 to the nearest FP8 E4M3 value (ties to even, saturating), still as fp32.

    Why not just ``x.to(tl.float8e4nv)``: the CPU interpreter's cast truncates (and drops
    the carry), so interpreted runs would not match torch. Rounding here, in integer
    arithmetic that every backend does the same way, leaves the cast exact, so kernel and
    torch reference match bit for bit on GPU and CPU alike. (The ~0.1% mismatch first seen
    on an H200 came from V's scale, not the cast: see ``fp8_channel_scale``.)
    """
    x = tl.minimum(tl.maximum(x, -_FP8_MAX), _FP8_MAX)
    bits = x.to(tl.int32, bitcast=True)
    # Normal range (|x| >= 2**-6): keep 3 mantissa bits, round half to even on the 20 dropped ones.
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
    normal = bits.to(tl.float32, bitcast=True)
    # Subnormal range: a multiple of 2**-9; adding 1.5 * 2**14 leaves exactly 9 fraction bits.
    sub = (x + 24576.0) - 24576.0
    return tl.where(tl.abs(x) >= 0.015625, normal, sub)


@triton.jit
def _quant_v_kernel(V, SCALE, V_T, V_RES_T, stride_vb, stride_vh, stride_vn, H, N_CTX, N_PAD,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, RESIDUAL: tl.constexpr):
    """Per-channel FP8 V (and its rounding residual), written transposed as [D, N_PAD]."""
    start = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    v = tl.load(V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :],
                mask=offs_n[:, None] < N_CTX, other=0.0).to(tl.float32)
    x = tl.trans(tl.math.div_rn(v, tl.load(SCALE + bh * HEAD_DIM + offs_d)[None, :]))  # IEEE, like torch
    hi = _round_to_e4m3(x)
    out = (bh * HEAD_DIM + offs_d[:, None]) * N_PAD + offs_n[None, :]
    tl.store(V_T + out, hi.to(tl.float8e4nv))
    if RESIDUAL:
        # x - hi is exact (they are within one FP8 step), so is the gain (a power of two).
        res = _round_to_e4m3((x - hi) * _V_RESIDUAL_GAIN)
        tl.store(V_RES_T + out, res.to(tl.float8e4nv))


def quantize_qk_int(x: torch.Tensor, group: int, bits: int, n_pad: int, fold: float = 1.0, mean=None):
    """CUDA twin of :func:`neutrain.attention.quant.quantize_int_per_group` (optionally minus ``mean``)."""
    b, h, n, d = x.shape
    x_int = torch.empty((b, h, n_pad, d), dtype=torch.int8, device=x.device)
    scale = torch.empty((b, h, n_pad), dtype=torch.float32, device=x.device)
    mean_arg = mean.reshape(b * h, d).contiguous() if mean is not None else scale
    _quant_int_kernel[(n_pad // group, b * h)](
        x, mean_arg, x_int, scale, x.stride(0), x.stride(1), x.stride(2), h, n, n_pad, fold,
        127.0 if bits == 8 else 7.0, HEAD_DIM=d, GROUP=group, SUBTRACT_MEAN=mean is not None, num_warps=2)
    return x_int, scale


def quantize_v_fp8(v: torch.Tensor, n_pad: int, residual: bool = True):
    """CUDA twin of :func:`neutrain.attention.quant.quantize_v_fp8_transposed`."""
    b, h, n, d = v.shape
    scale = fp8_channel_scale(v).contiguous()
    v_t = torch.empty((b, h, d, n_pad), dtype=torch.float8_e4m3fn, device=v.device)
    v_res = torch.empty_like(v_t) if residual else None
    _quant_v_kernel[(n_pad // TILE, b * h)](
        v, scale, v_t, v_res if residual else v_t, v.stride(0), v.stride(1), v.stride(2), h, n, n_pad,
        HEAD_DIM=d, BLOCK_N=TILE, RESIDUAL=residual, num_warps=4)
    return v_t, v_res, scale
