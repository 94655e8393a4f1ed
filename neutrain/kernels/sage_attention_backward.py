"""Triton backward kernels of SageAttention2 (straight-through, FA2 style).

A KV-owned kernel computes dK and dV (looping over the GQA group's query heads), a
Q-owned kernel computes dQ. Both recompute S from the same INT8 Q and K as the forward
(:mod:`neutrain.kernels.sage_attention`); dV uses the forward's FP8 P, rebuilt from each
KV tile alone; dP = dO . V_hat^T runs in bf16; Delta = rowsum(dO * O) comes from the stored O.

The pure-PyTorch twin is :func:`neutrain.attention.reference.sage_reference_backward`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from neutrain.kernels import interpreting
from neutrain.kernels.sage_attention import _INV_FP8_MAX, _INV_V_RESIDUAL_GAIN, _LOG2_FP8_MAX, _bf16, _query_block, _segments
from neutrain.kernels.sage_format import LN2, TILE, QuantizedAttentionInputs

# Triton kernels may read module globals only when they are constexpr.
_LN2 = tl.constexpr(LN2)


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


#: Benchmarks may set ((BLOCK_M, warps, stages) of dK/dV, (BLOCK_M, BLOCK_N, warps, stages) of dQ).
BACKWARD_CONFIG_OVERRIDE: tuple | None = None


def _backward_config():
    if interpreting():
        return (16, 4, 1), (32, 32, 4, 1)
    if BACKWARD_CONFIG_OVERRIDE is not None:
        return BACKWARD_CONFIG_OVERRIDE
    # 8 warps: dK and dV accumulate [128, D] fp32 each; BLOCK_M=64 spills at D=128.
    return (32, 8, 2), (128, 64, 8, 2)



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
