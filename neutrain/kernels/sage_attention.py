"""Triton kernels for SageAttention2 (INT8 QK, FP8 PV) with a straight-through backward: the forward.

Forward (one program per BLOCK_M queries of one (batch, head)):
  * S = (Q_int8 . K_int8^T) as an int32 ``wgmma`` (IGMMA in SASS), scaled in fp32 by the
    per-token Q scale (which carries ``softmax_scale*log2e``) and K scale;
    optional Q-smoothing correction ``dS = q_mean . K^T`` from a bf16 dot.
  * Online softmax in the exp2 domain. Each KV tile's P is quantized to FP8 E4M3
    against the tile's own row max with the fixed scale 448 (``p*448 in [0, 448]``),
    so a sink token in an early tile cannot push later tiles' P into underflow, and
    the backward can rebuild exactly the forward's FP8 P from the tile alone.
  * PV = P_fp8 . V_fp8 as an FP8 ``wgmma`` (QGMMA) into a fresh fp32 accumulator per
    tile (Hopper's FP8 accumulator keeps ~22 bits), then added into the fp32 output
    accumulator with the online-softmax rescale: two-level accumulation.
Backward: straight-through, FA2 style, in :mod:`neutrain.kernels.sage_attention_backward`;
it recomputes S from the same INT8 Q and K. The fused quantization kernels that produce
the inputs are in :mod:`neutrain.kernels.sage_quant`, their shared format in
:mod:`neutrain.kernels.sage_format`.

The pure-PyTorch twin of every step is :mod:`neutrain.attention.reference`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from neutrain.kernels import interpreting
from neutrain.kernels.sage_format import FP8_MAX, LOG2_FP8_MAX, TILE, V_RESIDUAL_GAIN, QuantizedAttentionInputs

# Triton kernels may read module globals only when they are constexpr.
_INV_FP8_MAX = tl.constexpr(1.0 / FP8_MAX)
_LOG2_FP8_MAX = tl.constexpr(LOG2_FP8_MAX)
_INV_V_RESIDUAL_GAIN = tl.constexpr(1.0 / V_RESIDUAL_GAIN)


@triton.jit
def _bf16(x, EMULATE: tl.constexpr):
    """A 16-bit MMA operand. Triton's CPU interpreter miscomputes bf16 dots, so when
    interpreting the operand is rounded to bf16 and widened back to fp32."""
    y = x.to(tl.bfloat16)
    if EMULATE:
        y = y.to(tl.float32)
    return y


@triton.jit
def _int32_to_f32(x):
    """Exact int32 -> fp32 for |x| < 2**22 (|q.k| <= 127*127*128 < 2**21): an integer add and a
    float subtract run at full rate, where the I2F conversion runs at a quarter of it."""
    return (x + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def _softmax_tile(qk, k_scale, q_scale, q_mean, k_t, offs_m, offs_n, seg_q, segk_base, m_i, l_i, N_CTX,
                  APPLY_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr,
                  SMOOTH_Q: tl.constexpr, K_TILE_SCALE: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """One KV tile's online-softmax step: the FP8 P (x448 against the tile's row max), the
    rescale factors of the running (alpha) and the tile's (beta) accumulators, new m and l.

    ``k_scale`` is a [BLOCK_N] vector, or with ``K_TILE_SCALE`` the tile's one scalar: then
    both scales fold into one row factor, and the raw integer scores feed max and exp2's FMA
    directly (no multiply per score). A positive row factor commutes with the row max.
    """
    s = _int32_to_f32(qk)
    if K_TILE_SCALE:
        row_scale = q_scale * k_scale
    else:
        # Order (qk*ks)*qs is the reference's and the backward's.
        s = s * k_scale[None, :]
        row_scale = q_scale
    if SMOOTH_Q:
        s = s * row_scale[:, None]
        s += tl.dot(_bf16(q_mean, EMULATE_BF16), _bf16(k_t.to(tl.float32), EMULATE_BF16)) * k_scale[None, :]
    if APPLY_MASK:
        allowed = offs_n[None, :] < N_CTX
        if IS_CAUSAL:
            allowed = allowed & (offs_m[:, None] >= offs_n[None, :])
        if HAS_SEG:
            seg_k = tl.load(segk_base + offs_n, mask=offs_n < N_CTX, other=-2)
            allowed = allowed & (seg_q[:, None] == seg_k[None, :])
        s = tl.where(allowed, s, float("-inf"))
    if SMOOTH_Q:
        m_tile = tl.max(s, 1)
    else:
        m_tile = tl.max(s, 1) * row_scale
    m_new = tl.maximum(m_i, m_tile)
    if APPLY_MASK:
        # Rows with no allowed key in this tile (or so far) must give 0, not NaN.
        m_tile_safe = tl.where(m_tile == float("-inf"), 0.0, m_tile)
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_tile_safe = m_tile
        m_new_safe = m_new
    if SMOOTH_Q:
        p448 = tl.math.exp2(s - (m_tile_safe - _LOG2_FP8_MAX)[:, None])
    else:
        p448 = tl.math.exp2(s * row_scale[:, None] - (m_tile_safe - _LOG2_FP8_MAX)[:, None])
    alpha = tl.math.exp2(m_i - m_new_safe)
    beta = tl.math.exp2(m_tile - m_new_safe)
    l_i = l_i * alpha + tl.sum(p448, 1) * (beta * _INV_FP8_MAX)
    return p448.to(tl.float8e4nv), alpha, beta, m_new, l_i


@triton.jit
def _pv_tile(acc, p_fp8, vt_base, vr_base, offs_n, alpha, beta, stride_vd,
             HEAD_DIM: tl.constexpr, V_RESIDUAL: tl.constexpr):
    """acc * alpha + (P_fp8 . V_fp8 [+ residual]) * beta / 448: the two-level PV accumulation."""
    offs_d = tl.arange(0, HEAD_DIM)
    v_off = offs_d[None, :] * stride_vd + offs_n[:, None]  # [BLOCK_N, D] view of V^T
    v = tl.load(vt_base + v_off)
    if V_RESIDUAL:
        # The residual's product seeds the tile accumulator; within one tile the FP8
        # wgmma accumulator (~22 bits) keeps it far below FP8's own rounding.
        pv = tl.dot(p_fp8, tl.load(vr_base + v_off)) * _INV_V_RESIDUAL_GAIN
        pv = tl.dot(p_fp8, v, pv)
    else:
        pv = tl.dot(p_fp8, v)  # fresh fp32 accumulator: first level
    return acc * alpha[:, None] + pv * (beta * _INV_FP8_MAX)[:, None]  # second level, fp32


@triton.jit
def _load_k(k_base, ks_base, offs_n, stride_kn, HEAD_DIM: tl.constexpr, K_TILE_SCALE: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    k_t = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None])
    if K_TILE_SCALE:
        k_scale = tl.load(ks_base + tl.min(offs_n, 0))
    else:
        k_scale = tl.load(ks_base + offs_n)
    return k_t, k_scale


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, q_scale, q_mean, offs_m, seg_q,
               k_base, ks_base, vt_base, vr_base, segk_base, stride_kn, stride_vd, lo, hi, N_CTX,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, APPLY_MASK: tl.constexpr,
               IS_CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr, SMOOTH_Q: tl.constexpr,
               V_RESIDUAL: tl.constexpr, K_TILE_SCALE: tl.constexpr, EMULATE_BF16: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_t, k_scale = _load_k(k_base, ks_base, offs_n, stride_kn, HEAD_DIM, K_TILE_SCALE)
        qk = tl.dot(q, k_t, out_dtype=tl.int32)
        p_fp8, alpha, beta, m_i, l_i = _softmax_tile(
            qk, k_scale, q_scale, q_mean, k_t, offs_m, offs_n, seg_q, segk_base, m_i, l_i, N_CTX,
            APPLY_MASK, IS_CAUSAL, HAS_SEG, SMOOTH_Q, K_TILE_SCALE, EMULATE_BF16)
        acc = _pv_tile(acc, p_fp8, vt_base, vr_base, offs_n, alpha, beta, stride_vd, HEAD_DIM, V_RESIDUAL)
    return acc, l_i, m_i


@triton.jit
def _fwd_tiles_pipelined(acc, l_i, m_i, q, q_scale, offs_m, k_base, ks_base, vt_base, vr_base,
                         stride_kn, stride_vd, lo, hi, N_CTX,
                         HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, V_RESIDUAL: tl.constexpr,
                         K_TILE_SCALE: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """The unmasked tiles [lo, hi) (hi > lo), software-pipelined by hand (FA3's intra-warpgroup
    overlap): each iteration runs tile c-1's PV product (a synchronous wgmma), then issues tile
    c+1's QK wgmma, then tile c's softmax. Triton keeps that QK wgmma in flight through the
    softmax: its result is only yielded, and its previous value is read after the PV's wait
    (rule 3b of Triton's WGMMAPipeline), so tensor cores and the FP32/MUFU pipes overlap."""
    offs_b = tl.arange(0, BLOCK_N)
    k_t, k_scale = _load_k(k_base, ks_base, lo + offs_b, stride_kn, HEAD_DIM, K_TILE_SCALE)
    qk = tl.dot(q, k_t, out_dtype=tl.int32)
    p_fp8, alpha, beta, m_i, l_i = _softmax_tile(
        qk, k_scale, q_scale, q_scale, qk, offs_m, lo + offs_b, offs_m, k_base, m_i, l_i, N_CTX,
        False, False, False, False, K_TILE_SCALE, EMULATE_BF16)
    nxt = tl.minimum(lo + BLOCK_N, hi - BLOCK_N)  # past the end: recompute the last tile, unused
    k_t, k_scale = _load_k(k_base, ks_base, nxt + offs_b, stride_kn, HEAD_DIM, K_TILE_SCALE)
    qk = tl.dot(q, k_t, out_dtype=tl.int32)
    for start_n in range(lo + BLOCK_N, hi, BLOCK_N):  # start_n: the tile whose QK is in qk
        acc = _pv_tile(acc, p_fp8, vt_base, vr_base, start_n - BLOCK_N + offs_b, alpha, beta, stride_vd,
                       HEAD_DIM, V_RESIDUAL)
        nxt = tl.minimum(start_n + BLOCK_N, hi - BLOCK_N)
        k_n, k_scale_n = _load_k(k_base, ks_base, nxt + offs_b, stride_kn, HEAD_DIM, K_TILE_SCALE)
        qk_n = tl.dot(q, k_n, out_dtype=tl.int32)
        p_fp8, alpha, beta, m_i, l_i = _softmax_tile(
            qk, k_scale, q_scale, q_scale, qk, offs_m, start_n + offs_b, offs_m, k_base, m_i, l_i, N_CTX,
            False, False, False, False, K_TILE_SCALE, EMULATE_BF16)
        qk, k_scale = qk_n, k_scale_n
    acc = _pv_tile(acc, p_fp8, vt_base, vr_base, hi - BLOCK_N + offs_b, alpha, beta, stride_vd, HEAD_DIM, V_RESIDUAL)
    return acc, l_i, m_i


@triton.jit
def _query_block(Q, QS, QM, SEGQ, stride_qb, stride_qh, stride_qn, H, N_CTX, N_PAD, GROUPS,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, IS_CAUSAL: tl.constexpr,
                 HAS_SEG: tl.constexpr, SMOOTH_Q: tl.constexpr):
    """This program's query block: indices, INT8 Q, its scales, Q mean and segment ids."""
    start_m = tl.program_id(0)
    if IS_CAUSAL:  # heaviest query blocks first: a shorter tail
        start_m = tl.num_programs(0) - 1 - start_m
    off_bh = tl.program_id(1)
    b = off_bh // H
    h = off_bh % H
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_off = b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :]
    q = tl.load(Q + q_off)
    q_scale = tl.load(QS + (b * H + h) * N_PAD + offs_m)
    q_mean = q_scale  # placeholder when SMOOTH_Q is off (never read)
    if SMOOTH_Q:
        q_mean = tl.load(QM + q_off)
    seg_q = offs_m
    if HAS_SEG:
        seg_q = tl.load(SEGQ + b * N_CTX + offs_m, mask=offs_m < N_CTX, other=-1)
    return start_m, b, h, h // GROUPS, offs_m, q, q_scale, q_mean, seg_q


@triton.jit
def _sage_fwd_kernel(Q, QS, QM, K, KS, VT, VR, VS, SEGQ, SEGK, O, LSE,
                     stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                     stride_vb, stride_vh, stride_vd, stride_ob, stride_oh, stride_on,
                     H, N_CTX, N_PAD, GROUPS,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     IS_CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr, SMOOTH_Q: tl.constexpr,
                     V_RESIDUAL: tl.constexpr, K_TILE_SCALE: tl.constexpr, PIPELINE: tl.constexpr,
                     EMULATE_BF16: tl.constexpr):
    start_m, b, h, hk, offs_m, q, q_scale, q_mean, seg_q = _query_block(
        Q, QS, QM, SEGQ, stride_qb, stride_qh, stride_qn, H, N_CTX, N_PAD, GROUPS,
        HEAD_DIM, BLOCK_M, IS_CAUSAL, HAS_SEG, SMOOTH_Q)
    HK = H // GROUPS
    offs_d = tl.arange(0, HEAD_DIM)
    k_base = K + b * stride_kb + hk * stride_kh
    ks_base = KS + (b * HK + hk) * N_PAD
    vt_base = VT + b * stride_vb + hk * stride_vh
    vr_base = VR + b * stride_vb + hk * stride_vh
    segk_base = SEGK + b * N_CTX

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if IS_CAUSAL:
        full_hi = (start_m * BLOCK_M) // BLOCK_N * BLOCK_N
        masked_hi = tl.minimum((start_m + 1) * BLOCK_M, N_CTX)
    else:
        full_hi = N_CTX // BLOCK_N * BLOCK_N
        masked_hi = N_CTX
    # Tiles wholly inside the allowed region skip mask arithmetic (unless segments are in play).
    if PIPELINE:  # the host sets PIPELINE only without segments and Q smoothing
        if full_hi > 0:
            acc, l_i, m_i = _fwd_tiles_pipelined(acc, l_i, m_i, q, q_scale, offs_m, k_base, ks_base, vt_base,
                                                 vr_base, stride_kn, stride_vd, 0, full_hi, N_CTX, HEAD_DIM,
                                                 BLOCK_N, V_RESIDUAL, K_TILE_SCALE, EMULATE_BF16)
    else:
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, q_scale, q_mean, offs_m, seg_q,
                                   k_base, ks_base, vt_base, vr_base, segk_base, stride_kn, stride_vd, 0, full_hi,
                                   N_CTX, HEAD_DIM, BLOCK_N, HAS_SEG, IS_CAUSAL, HAS_SEG, SMOOTH_Q, V_RESIDUAL,
                                   K_TILE_SCALE, EMULATE_BF16)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, q_scale, q_mean, offs_m, seg_q,
                               k_base, ks_base, vt_base, vr_base, segk_base, stride_kn, stride_vd, full_hi,
                               masked_hi, N_CTX, HEAD_DIM, BLOCK_N, True, IS_CAUSAL, HAS_SEG, SMOOTH_Q,
                               V_RESIDUAL, K_TILE_SCALE, EMULATE_BF16)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    v_scale = tl.load(VS + (b * HK + hk) * HEAD_DIM + offs_d)
    out = acc / l_safe[:, None] * v_scale[None, :]
    o_off = b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :]
    tl.store(O + o_off, out.to(O.dtype.element_ty), mask=offs_m[:, None] < N_CTX)
    lse = tl.where(empty, float("inf"), m_i + tl.math.log2(l_safe))
    tl.store(LSE + (b * H + h) * N_PAD + offs_m, lse)


class ForwardConfig(NamedTuple):
    """Launch settings of the forward kernel (autotuned by ``benchmarks/attention/attention.py``, shipped in
    ``neutrain/attention/dispatch_table.json`` per device).

    ``pipeline``: the hand-pipelined main loop (QK wgmma of the next tile in flight during this
    tile's softmax), used where the call has no segments and no Q smoothing. Whether K carries
    one scale per 128-key tile (folded into the row factor) is a property of the quantized
    inputs (``k_group``), chosen by the caller.
    """

    block_m: int = 128
    num_warps: int = 8
    num_stages: int = 3
    pipeline: bool = False


#: Benchmarks may set a :class:`ForwardConfig` to sweep configurations.
FORWARD_CONFIG_OVERRIDE: ForwardConfig | None = None


def _forward_config(head_dim: int, causal: bool, config: ForwardConfig | None = None) -> ForwardConfig:
    """The forward's launch settings; the interpreter gets a small tile."""
    if interpreting():
        return ForwardConfig(32, 4, 1, config.pipeline if config is not None else False)
    if FORWARD_CONFIG_OVERRIDE is not None:
        return FORWARD_CONFIG_OVERRIDE
    if config is not None:
        return config
    return ForwardConfig(128, 8, 3 if head_dim == 128 else 4)



#: The compiled kernel of the latest launch, for machine-code checks.
_LAST_LAUNCH: dict = {}


def _segments(segment_q, segment_k, like):
    if segment_q is None:
        dummy = torch.zeros(1, dtype=torch.int32, device=like.device)
        return dummy, dummy, False
    return segment_q.to(torch.int32).contiguous(), segment_k.to(torch.int32).contiguous(), True


def sage_attention_forward(qi: QuantizedAttentionInputs, causal: bool, segment_q=None, segment_k=None,
                           out_dtype: torch.dtype = torch.bfloat16, config: ForwardConfig | None = None):
    """Launch the forward kernel. Returns ``(out [B,Hq,N,D], lse [B,Hq,Np] fp32)`` like the reference.

    ``lse`` is the log2-domain log-sum-exp of the smoothed, scaled scores (see
    :func:`neutrain.attention.quant.natural_lse` for the natural-log LSE of the true scores).
    """
    b, h, n_pad, d = qi.q_int.shape
    groups = h // qi.k_int.shape[1]
    n = qi.seq_len
    out = torch.empty((b, h, n, d), dtype=out_dtype, device=qi.q_int.device)
    lse = torch.full((b, h, n_pad), float("inf"), dtype=torch.float32, device=qi.q_int.device)
    seg_q, seg_k, has_seg = _segments(segment_q, segment_k, qi.q_int)
    block_m, warps, stages, pipeline = _forward_config(d, causal, config)
    q_mean = qi.q_mean if qi.q_mean is not None else qi.q_int
    v_res = qi.v_residual_t if qi.v_residual_t is not None else qi.v_fp8_t
    grid = (triton.cdiv(n, block_m), b * h)
    _LAST_LAUNCH["forward"] = _sage_fwd_kernel[grid](
        qi.q_int, qi.q_scale, q_mean, qi.k_int, qi.k_scale, qi.v_fp8_t, v_res, qi.v_scale, seg_q, seg_k, out, lse,
        qi.q_int.stride(0), qi.q_int.stride(1), qi.q_int.stride(2),
        qi.k_int.stride(0), qi.k_int.stride(1), qi.k_int.stride(2),
        qi.v_fp8_t.stride(0), qi.v_fp8_t.stride(1), qi.v_fp8_t.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        h, n, n_pad, groups,
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=TILE, IS_CAUSAL=causal, HAS_SEG=has_seg,
        SMOOTH_Q=qi.q_mean is not None, V_RESIDUAL=qi.v_residual_t is not None,
        K_TILE_SCALE=qi.k_group == TILE, PIPELINE=pipeline and not has_seg and qi.q_mean is None,
        EMULATE_BF16=interpreting(), num_warps=warps, num_stages=stages,
    )
    return out, lse
