"""Triton kernels that quantize SageAttention's inputs on the GPU: INT8/INT4 Q and K per
token group, per-channel FP8 V with its rounding residual.

They are the CUDA twins of the torch quantizers in :mod:`neutrain.attention.quant`, and
produce bit-identical tensors given the same K mean and V scale (the tests compare them).

Two passes over K and V are unavoidable (K's mean and V's amax span all tokens before
any token can be quantized), so the layout is: :func:`kv_stats` reads K and V once with
several programs per head (partials, then a fixed-order second reduction), then
:func:`quantize_qk_int` (Q, then K) and :func:`quantize_v_fp8` read each input once more
with one :data:`TILE` of tokens per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from neutrain.kernels.sage_format import _MIN_AMAX, FP8_MAX, TILE, V_RESIDUAL_GAIN, fp8_channel_scale

# Triton kernels may read module globals only when they are constexpr.
_FP8_MAX = tl.constexpr(FP8_MAX)
_V_RESIDUAL_GAIN = tl.constexpr(V_RESIDUAL_GAIN)
_MIN_AMAX_C = tl.constexpr(_MIN_AMAX)

#: Tokens one stats program reduces: 1024 keeps ~16 programs per head at 16K tokens (enough
#: to fill the GPU at small batch x heads) while the partials stay a few KiB per head.
STATS_CHUNK = 1024
#: Tokens a stats program loads per step (a multiple of every chunk size used).
_STATS_BLOCK = 64


@triton.jit
def _kv_stats_kernel(K, V, PART_SUM, PART_MAX, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                     H, N_CTX, N_SPLIT, CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per CHUNK tokens of one head: partial per-channel sum of K and amax of |V|.

    Accumulates whole [BLOCK_N, HEAD_DIM] tiles and reduces over tokens once at the end, so
    the summation order is fixed by the shape alone (deterministic, no atomics).
    """
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_d = tl.arange(0, HEAD_DIM)
    acc_sum = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    acc_max = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for off in range(0, CHUNK, BLOCK_N):
        offs_n = split * CHUNK + off + tl.arange(0, BLOCK_N)
        keep = offs_n[:, None] < N_CTX
        k = tl.load(K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :], mask=keep,
                    other=0.0)
        v = tl.load(V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :], mask=keep,
                    other=0.0)
        acc_sum += k.to(tl.float32)
        acc_max = tl.maximum(acc_max, tl.abs(v.to(tl.float32)))
    out = (bh * N_SPLIT + split) * HEAD_DIM + offs_d
    tl.store(PART_SUM + out, tl.sum(acc_sum, 0))
    tl.store(PART_MAX + out, tl.max(acc_max, 0))


@triton.jit
def _kv_stats_finish_kernel(PART_SUM, PART_MAX, K_MEAN, V_SCALE, n_ctx, N_SPLIT, HEAD_DIM: tl.constexpr):
    """One program per head: the partials in split order, then K's mean and V's FP8 scale."""
    bh = tl.program_id(0)
    offs_d = tl.arange(0, HEAD_DIM)
    total = tl.zeros([HEAD_DIM], tl.float32)
    amax = tl.zeros([HEAD_DIM], tl.float32)
    for split in range(0, N_SPLIT):
        at = (bh * N_SPLIT + split) * HEAD_DIM + offs_d
        total += tl.load(PART_SUM + at)
        amax = tl.maximum(amax, tl.load(PART_MAX + at))
    tl.store(K_MEAN + bh * HEAD_DIM + offs_d, tl.math.div_rn(total, n_ctx))
    # Exactly fp8_channel_scale: the amax is exact, the clamp and the IEEE division are what torch does.
    tl.store(V_SCALE + bh * HEAD_DIM + offs_d, tl.math.div_rn(tl.maximum(amax, _MIN_AMAX_C), _FP8_MAX))


@triton.jit
def _quant_int_kernel(X, MEAN, X_INT, SCALE, stride_xb, stride_xh, stride_xn, H, N_CTX, N_PAD, fold, qmax,
                      HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                      SUBTRACT_MEAN: tl.constexpr):
    """One program per BLOCK_N tokens (BLOCK_N / GROUP groups) of one head: symmetric integer
    quantization (Q or smoothed K), one scale per group."""
    NUM_GROUPS: tl.constexpr = BLOCK_N // GROUP
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    # [groups, tokens of a group, channels]: each group's amax is a reduction over the last two axes.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, NUM_GROUPS)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    offs_d = tl.arange(0, HEAD_DIM)[None, None, :]
    keep = offs_n[:, :, None] < N_CTX
    x = tl.load(X + b * stride_xb + h * stride_xh + offs_n[:, :, None] * stride_xn + offs_d, mask=keep,
                other=0.0).to(tl.float32)
    if SUBTRACT_MEAN:
        x = tl.where(keep, x - tl.load(MEAN + bh * HEAD_DIM + offs_d), 0.0)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.max(tl.abs(x), 2), 1), 1e-6), qmax)
    # Round half to even like torch.round: adding 1.5 * 2**23 leaves no fraction bits
    # (|x / scale| <= 127), and the CPU interpreter computes it the same way.
    x_int = (tl.math.div_rn(x, scale[:, None, None]) + 12582912.0) - 12582912.0
    x_int = tl.minimum(tl.maximum(x_int, -qmax), qmax)
    tl.store(X_INT + (bh * N_PAD + offs_n[:, :, None]) * HEAD_DIM + offs_d, x_int.to(tl.int8))
    tl.store(SCALE + bh * N_PAD + offs_n, tl.zeros([NUM_GROUPS, GROUP], tl.float32) + (scale * fold)[:, None])


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
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    # Subnormal range: a multiple of 2**-9; adding 1.5 * 2**14 leaves exactly 9 fraction bits.
    sub = (x + 24576.0) - 24576.0
    rounded = tl.where(tl.abs(x) >= 0.015625, normal, sub).to(tl.int32, bitcast=True)
    # Rounding keeps the sign, except that a negative x rounding to zero came out +0 above where
    # torch's cast gives -0 (e.g. V's residual): x's sign bit restores it, so FP8 bits match too.
    return (rounded | (bits & -2147483648)).to(tl.float32, bitcast=True)


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


def kv_stats(k: torch.Tensor, v: torch.Tensor, chunk: int | None = None):
    """K's per-channel fp32 mean over tokens ``[B, H, 1, D]`` and V's FP8 scale ``[B, H, D]``
    (exactly :func:`~neutrain.kernels.sage_format.fp8_channel_scale`), in one read of each.

    The mean matches ``k.mean(dim=2, dtype=float32)`` to fp32 rounding (another summation
    order), and is the same on every run for a given shape and ``chunk`` (tokens per program,
    default :data:`STATS_CHUNK`).
    """
    chunk = STATS_CHUNK if chunk is None else chunk
    if k.shape != v.shape:
        raise ValueError(f"K {tuple(k.shape)} and V {tuple(v.shape)} must have one shape")
    if chunk % _STATS_BLOCK:
        raise ValueError(f"chunk {chunk} must be a multiple of {_STATS_BLOCK}")
    b, h, n, d = k.shape
    n_split = triton.cdiv(n, chunk)
    part_sum = torch.empty((b * h, n_split, d), dtype=torch.float32, device=k.device)
    part_max = torch.empty_like(part_sum)
    _kv_stats_kernel[(n_split, b * h)](
        k, v, part_sum, part_max, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        h, n, n_split, CHUNK=chunk, HEAD_DIM=d, BLOCK_N=_STATS_BLOCK, num_warps=8)
    k_mean = torch.empty((b, h, 1, d), dtype=torch.float32, device=k.device)
    v_scale = torch.empty((b, h, d), dtype=torch.float32, device=k.device)
    _kv_stats_finish_kernel[(b * h,)](part_sum, part_max, k_mean, v_scale, float(n), n_split, HEAD_DIM=d,
                                      num_warps=1)
    return k_mean, v_scale


def quantize_qk_int(x: torch.Tensor, group: int, bits: int, n_pad: int, fold: float = 1.0, mean=None,
                    block_n: int = TILE):
    """CUDA twin of :func:`neutrain.attention.quant.quantize_int_per_group` (optionally minus ``mean``).

    ``block_n`` tokens per program (a multiple of ``group`` dividing ``n_pad``); ``block_n=group``
    with 2 warps is the older launch of one group per program.
    """
    b, h, n, d = x.shape
    if block_n % group or n_pad % block_n:
        raise ValueError(f"block_n {block_n} must be a multiple of group {group} and divide n_pad {n_pad}")
    x_int = torch.empty((b, h, n_pad, d), dtype=torch.int8, device=x.device)
    scale = torch.empty((b, h, n_pad), dtype=torch.float32, device=x.device)
    mean_arg = mean.reshape(b * h, d).contiguous() if mean is not None else scale
    _quant_int_kernel[(n_pad // block_n, b * h)](
        x, mean_arg, x_int, scale, x.stride(0), x.stride(1), x.stride(2), h, n, n_pad, fold,
        127.0 if bits == 8 else 7.0, HEAD_DIM=d, GROUP=group, BLOCK_N=block_n, SUBTRACT_MEAN=mean is not None,
        num_warps=2 if block_n == group else 8)
    return x_int, scale


def quantize_v_fp8(v: torch.Tensor, n_pad: int, residual: bool = True, scale=None):
    """CUDA twin of :func:`neutrain.attention.quant.quantize_v_fp8_transposed`; ``scale``: V's
    per-channel scale when already known (from :func:`kv_stats`), else computed here in torch."""
    b, h, n, d = v.shape
    scale = (fp8_channel_scale(v) if scale is None else scale).contiguous()
    v_t = torch.empty((b, h, d, n_pad), dtype=torch.float8_e4m3fn, device=v.device)
    v_res = torch.empty_like(v_t) if residual else None
    _quant_v_kernel[(n_pad // TILE, b * h)](
        v, scale, v_t, v_res if residual else v_t, v.stride(0), v.stride(1), v.stride(2), h, n, n_pad,
        HEAD_DIM=d, BLOCK_N=TILE, RESIDUAL=residual, num_warps=4)
    return v_t, v_res, scale
