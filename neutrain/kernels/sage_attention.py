"""Triton kernels for SageAttention2 (INT8 QK, FP8 PV) with a straight-through backward.

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
Backward (straight-through, FA2 style): a KV-owned kernel computes dK and dV (looping
over the GQA group's query heads), a Q-owned kernel computes dQ. Both recompute S
from the same INT8 Q and K; dV uses the forward's FP8 P; dP = dO . V_hat^T runs in
bf16; Delta = rowsum(dO * O) comes from the stored O.

The pure-PyTorch twin of every step is :mod:`neutrain.attention.reference`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from neutrain.attention.quant import FP8_MAX, LN2, LOG2_FP8_MAX, TILE, V_RESIDUAL_GAIN, QuantizedAttentionInputs, fp8_channel_scale
from neutrain.kernels import interpreting

# Triton kernels may read module globals only when they are constexpr.
_FP8_MAX = tl.constexpr(FP8_MAX)
_INV_FP8_MAX = tl.constexpr(1.0 / FP8_MAX)
_LOG2_FP8_MAX = tl.constexpr(LOG2_FP8_MAX)
_LN2 = tl.constexpr(LN2)
_INV_V_RESIDUAL_GAIN = tl.constexpr(1.0 / V_RESIDUAL_GAIN)
_V_RESIDUAL_GAIN = tl.constexpr(V_RESIDUAL_GAIN)


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


@triton.jit
def _sage_bwd_dkdv_kernel(Q, QS, QM, K, KS, VT, VR, VS, SEGQ, SEGK, DO, LSE, DELTA, DK, DV,
                          stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                          stride_vb, stride_vh, stride_vd, stride_dob, stride_doh, stride_don,
                          stride_gb, stride_gh, stride_gn,
                          H, N_CTX, N_PAD, GROUPS,
                          HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          IS_CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr, SMOOTH_Q: tl.constexpr,
                          NEED_MASK: tl.constexpr, V_RESIDUAL: tl.constexpr,
                        EMULATE_BF16: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    off_bhk = tl.program_id(1)
    HK = H // GROUPS
    b = off_bhk // HK
    hk = off_bhk % HK
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k = tl.load(K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :])
    k_scale = tl.load(KS + (b * HK + hk) * N_PAD + offs_n)
    # V_hat = v_fp8 * v_scale[channel]; the scale goes onto dO so the FP8 values enter bf16 exactly.
    v_off = b * stride_vb + hk * stride_vh + offs_d[None, :] * stride_vd + offs_n[:, None]
    v = tl.load(VT + v_off).to(tl.float32)
    if V_RESIDUAL:
        v += tl.load(VR + v_off).to(tl.float32) * _INV_V_RESIDUAL_GAIN
    v = _bf16(v, EMULATE_BF16)
    v_scale = tl.load(VS + (b * HK + hk) * HEAD_DIM + offs_d)
    seg_k = offs_n
    if HAS_SEG:
        seg_k = tl.load(SEGK + b * N_CTX + offs_n, mask=offs_n < N_CTX, other=-2)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    lo = 0
    if IS_CAUSAL:
        lo = start_n // BLOCK_M * BLOCK_M
    for g in range(GROUPS):
        h = hk * GROUPS + g
        for start_m in range(lo, N_CTX, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q_off = b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :]
            q = tl.load(Q + q_off)
            q_scale = tl.load(QS + (b * H + h) * N_PAD + offs_m)
            qk_t = tl.dot(k, tl.trans(q), out_dtype=tl.int32)
            s_t = qk_t.to(tl.float32) * k_scale[:, None] * q_scale[None, :]  # same rounding order as forward
            q_hat = q.to(tl.float32) * q_scale[:, None]
            if SMOOTH_Q:
                q_mean = tl.load(QM + q_off)
                s_t += tl.dot(_bf16(k.to(tl.float32), EMULATE_BF16), tl.trans(_bf16(q_mean, EMULATE_BF16))) * k_scale[:, None]
                q_hat += q_mean.to(tl.float32)
            if NEED_MASK:
                allowed = offs_n[:, None] < N_CTX
                if IS_CAUSAL:
                    allowed = allowed & (offs_m[None, :] >= offs_n[:, None])
                if HAS_SEG:
                    seg_q = tl.load(SEGQ + b * N_CTX + offs_m, mask=offs_m < N_CTX, other=-1)
                    allowed = allowed & (seg_q[None, :] == seg_k[:, None])
                s_t = tl.where(allowed, s_t, float("-inf"))
            lse = tl.load(LSE + (b * H + h) * N_PAD + offs_m)
            p_t = tl.math.exp2(s_t - lse[None, :])
            # The forward's FP8 P: quantized against this KV tile's row max, then renormalized.
            m_tile = tl.max(s_t, 0)
            m_tile = tl.where(m_tile == float("-inf"), 0.0, m_tile)
            p_fp8 = tl.math.exp2(s_t - (m_tile - _LOG2_FP8_MAX)[None, :]).to(tl.float8e4nv)
            renorm = tl.math.exp2(m_tile - lse) * _INV_FP8_MAX
            p_hat_t = _bf16(p_fp8.to(tl.float32) * renorm[None, :], EMULATE_BF16)
            do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_don + offs_d[None, :],
                         mask=offs_m[:, None] < N_CTX, other=0.0)
            dv += tl.dot(p_hat_t, _bf16(do, EMULATE_BF16))
            do_scaled = _bf16(do.to(tl.float32) * v_scale[None, :], EMULATE_BF16)
            dp_t = tl.dot(v, tl.trans(do_scaled))
            delta = tl.load(DELTA + (b * H + h) * N_PAD + offs_m)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(_bf16(ds_t, EMULATE_BF16), _bf16(q_hat, EMULATE_BF16))
    g_off = b * stride_gb + hk * stride_gh + offs_n[:, None] * stride_gn + offs_d[None, :]
    keep = offs_n[:, None] < N_CTX
    tl.store(DK + g_off, (dk * _LN2).to(DK.dtype.element_ty), mask=keep)
    tl.store(DV + g_off, dv.to(DV.dtype.element_ty), mask=keep)


@triton.jit
def _sage_bwd_dq_kernel(Q, QS, QM, K, KS, VT, VR, VS, SEGQ, SEGK, DO, LSE, DELTA, DQ,
                        stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                        stride_vb, stride_vh, stride_vd, stride_dob, stride_doh, stride_don,
                        stride_gb, stride_gh, stride_gn,
                        H, N_CTX, N_PAD, GROUPS, softmax_scale,
                        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        IS_CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr, SMOOTH_Q: tl.constexpr,
                        NEED_MASK: tl.constexpr, V_RESIDUAL: tl.constexpr,
                        EMULATE_BF16: tl.constexpr):
    start_m, b, h, hk, offs_m, q, q_scale, q_mean, seg_q = _query_block(
        Q, QS, QM, SEGQ, stride_qb, stride_qh, stride_qn, H, N_CTX, N_PAD, GROUPS,
        HEAD_DIM, BLOCK_M, IS_CAUSAL, HAS_SEG, SMOOTH_Q)
    HK = H // GROUPS
    offs_d = tl.arange(0, HEAD_DIM)
    lse = tl.load(LSE + (b * H + h) * N_PAD + offs_m)
    delta = tl.load(DELTA + (b * H + h) * N_PAD + offs_m)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_don + offs_d[None, :],
                 mask=offs_m[:, None] < N_CTX, other=0.0)
    v_scale = tl.load(VS + (b * HK + hk) * HEAD_DIM + offs_d)
    do_scaled = _bf16(do.to(tl.float32) * v_scale[None, :], EMULATE_BF16)
    k_base = K + b * stride_kb + hk * stride_kh
    vt_base = VT + b * stride_vb + hk * stride_vh
    vr_base = VR + b * stride_vb + hk * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    hi = N_CTX
    if IS_CAUSAL:
        hi = tl.minimum((start_m + 1) * BLOCK_M, N_CTX)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :])
        k_scale = tl.load(KS + (b * HK + hk) * N_PAD + offs_n)
        s = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32) * k_scale[None, :] * q_scale[:, None]
        if SMOOTH_Q:
            s += tl.dot(_bf16(q_mean, EMULATE_BF16), tl.trans(_bf16(k.to(tl.float32), EMULATE_BF16))) * k_scale[None, :]
        if NEED_MASK:
            allowed = offs_n[None, :] < N_CTX
            if IS_CAUSAL:
                allowed = allowed & (offs_m[:, None] >= offs_n[None, :])
            if HAS_SEG:
                seg_k = tl.load(SEGK + b * N_CTX + offs_n, mask=offs_n < N_CTX, other=-2)
                allowed = allowed & (seg_q[:, None] == seg_k[None, :])
            s = tl.where(allowed, s, float("-inf"))
        p = tl.math.exp2(s - lse[:, None])
        v_off = offs_d[:, None] * stride_vd + offs_n[None, :]
        v_t = tl.load(vt_base + v_off).to(tl.float32)
        if V_RESIDUAL:
            v_t += tl.load(vr_base + v_off).to(tl.float32) * _INV_V_RESIDUAL_GAIN
        v_t = _bf16(v_t, EMULATE_BF16)
        dp = tl.dot(do_scaled, v_t)
        ds = p * (dp - delta[:, None])
        k_hat = _bf16(k.to(tl.float32) * k_scale[:, None], EMULATE_BF16)
        dq += tl.dot(_bf16(ds, EMULATE_BF16), k_hat)
    g_off = b * stride_gb + h * stride_gh + offs_m[:, None] * stride_gn + offs_d[None, :]
    tl.store(DQ + g_off, (dq * softmax_scale).to(DQ.dtype.element_ty), mask=offs_m[:, None] < N_CTX)


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


class ForwardConfig(NamedTuple):
    """Launch settings of the forward kernel (autotuned by ``benchmarks/attention.py``, shipped in
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


#: Benchmarks may set ((BLOCK_M, warps, stages) of dK/dV, (BLOCK_M, BLOCK_N, warps, stages) of dQ).
BACKWARD_CONFIG_OVERRIDE: tuple | None = None


def _backward_config():
    if interpreting():
        return (16, 4, 1), (32, 32, 4, 1)
    if BACKWARD_CONFIG_OVERRIDE is not None:
        return BACKWARD_CONFIG_OVERRIDE
    # 8 warps: dK and dV accumulate [128, D] fp32 each; BLOCK_M=64 spills at D=128.
    return (32, 8, 2), (128, 64, 8, 2)


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


def sage_attention_backward(qi: QuantizedAttentionInputs, out, lse, grad_out, causal: bool,
                            segment_q=None, segment_k=None):
    """Launch the backward kernels. Returns fp32 ``(dq [B,Hq,N,D], dk, dv [B,Hk,N,D])``."""
    b, h, n_pad, d = qi.q_int.shape
    hk = qi.k_int.shape[1]
    groups = h // hk
    n = qi.seq_len
    dev = qi.q_int.device
    grad_out = grad_out.contiguous()
    delta = torch.zeros((b, h, n_pad), dtype=torch.float32, device=dev)
    delta[:, :, :n] = (grad_out.float() * out.float()).sum(-1)
    dq = torch.empty((b, h, n, d), dtype=torch.float32, device=dev)
    dk = torch.empty((b, hk, n, d), dtype=torch.float32, device=dev)
    dv = torch.empty_like(dk)
    seg_q, seg_k, has_seg = _segments(segment_q, segment_k, qi.q_int)
    need_mask = causal or has_seg or n % TILE != 0
    q_mean = qi.q_mean if qi.q_mean is not None else qi.q_int
    (bm_kv, w_kv, st_kv), (bm_q, bn_q, w_q, st_q) = _backward_config()
    v_res = qi.v_residual_t if qi.v_residual_t is not None else qi.v_fp8_t
    common = (qi.q_int, qi.q_scale, q_mean, qi.k_int, qi.k_scale, qi.v_fp8_t, v_res, qi.v_scale, seg_q, seg_k,
              grad_out, lse, delta)
    strides = (qi.q_int.stride(0), qi.q_int.stride(1), qi.q_int.stride(2),
               qi.k_int.stride(0), qi.k_int.stride(1), qi.k_int.stride(2),
               qi.v_fp8_t.stride(0), qi.v_fp8_t.stride(1), qi.v_fp8_t.stride(2),
               grad_out.stride(0), grad_out.stride(1), grad_out.stride(2))
    _sage_bwd_dkdv_kernel[(triton.cdiv(n, TILE), b * hk)](
        *common, dk, dv, *strides, dk.stride(0), dk.stride(1), dk.stride(2),
        h, n, n_pad, groups,
        HEAD_DIM=d, BLOCK_M=bm_kv, BLOCK_N=TILE, IS_CAUSAL=causal, HAS_SEG=has_seg,
        SMOOTH_Q=qi.q_mean is not None, NEED_MASK=need_mask,
        V_RESIDUAL=qi.v_residual_t is not None, EMULATE_BF16=interpreting(), num_warps=w_kv, num_stages=st_kv,
    )
    _sage_bwd_dq_kernel[(triton.cdiv(n, bm_q), b * h)](
        *common, dq, *strides, dq.stride(0), dq.stride(1), dq.stride(2),
        h, n, n_pad, groups, qi.softmax_scale,
        HEAD_DIM=d, BLOCK_M=bm_q, BLOCK_N=bn_q, IS_CAUSAL=causal, HAS_SEG=has_seg,
        SMOOTH_Q=qi.q_mean is not None, NEED_MASK=need_mask,
        V_RESIDUAL=qi.v_residual_t is not None, EMULATE_BF16=interpreting(), num_warps=w_q, num_stages=st_q,
    )
    return dq, dk, dv


def compiled_forward_asm(head_dim: int = 128, causal: bool = False, device: str = "cuda",
                         config: ForwardConfig | None = None, k_tile_scale: bool = False):
    """Compile the forward kernel for ``head_dim`` and return its ``asm`` dict (``'sass'``, ``'ptx'``...).

    Used by the machine-code test: the SASS must contain IGMMA (INT8 QK) and QGMMA (FP8 PV).
    """
    from neutrain.attention.quant import quantize_attention_inputs

    x = torch.randn(1, 1, 4 * TILE, head_dim, device=device, dtype=torch.bfloat16)
    qi = quantize_attention_inputs(x, x, x, head_dim ** -0.5, k_group=TILE if k_tile_scale else 16)
    sage_attention_forward(qi, causal, config=config)
    return _LAST_LAUNCH["forward"].asm
