"""MiniCache's 4-bit segment with its scales folded out of the decode loop (the fast path of
:func:`neutrain.kernels.minicache_attention.decode_attention`).

Dequantizing every element (an int-to-float conversion, a multiply-add with its scale, and for values two scale
loads) made the 4-bit loop compute-bound at 431 GB/s on an H200, 2.6x slower than SDPA over 3.6x more bytes in
bf16. Within one group the scales are constants of the sum: q . (min + c x scale) = (q x scale) . c + q . min for
keys (a range per channel and group of tokens), p . (min + c x scale) = (p x scale) . c + p . min for values (a
range per token and group of channels). So the codes go to the tensor cores as they are, and only the query and
p are scaled, once per group.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _codes_as_dot(codes, MAGIC: tl.constexpr, dot_dtype: tl.constexpr):
    """Low and high nibbles of packed 4-bit codes as the dot's operand: c, or 128 + c by an OR into bf16's
    exponent (no int-to-float conversion per element; 128 + c is exact in bf16)."""
    if MAGIC:
        lo = ((codes & 15).to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True).to(dot_dtype)
        hi = ((codes >> 4).to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True).to(dot_dtype)
    else:
        lo = (codes & 15).to(dot_dtype)
        hi = (codes >> 4).to(dot_dtype)
    return lo, hi


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _folded_scores(codes_ptrs, nmask, sc_ptr, mn_ptr, live, q_even_f, q_odd_f, i,
                   MAGIC: tl.constexpr, IEEE: tl.constexpr, dot_dtype: tl.constexpr):
    """Scores of one sub-block of tokens inside one key group: (q x scale) . c + q . min per channel, the codes
    read as they are (minus the 128s when MAGIC). [BLOCK_G, tokens]."""
    codes = tl.load(codes_ptrs, mask=nmask[:, None], other=0)
    lo, hi = _codes_as_dot(codes, MAGIC, dot_dtype)
    qs_e = (q_even_f * tl.load(sc_ptr + 2 * i, mask=live, other=0.0).to(tl.float32)[None, :]).to(dot_dtype)
    qs_o = (q_odd_f * tl.load(sc_ptr + 2 * i + 1, mask=live, other=0.0).to(tl.float32)[None, :]).to(dot_dtype)
    bias = tl.sum(q_even_f * tl.load(mn_ptr + 2 * i, mask=live, other=0.0).to(tl.float32)[None, :], axis=1)
    bias += tl.sum(q_odd_f * tl.load(mn_ptr + 2 * i + 1, mask=live, other=0.0).to(tl.float32)[None, :], axis=1)
    if MAGIC:
        bias -= 128.0 * (tl.sum(qs_e.to(tl.float32), axis=1) + tl.sum(qs_o.to(tl.float32), axis=1))
    return _dot(qs_e, tl.trans(lo), IEEE) + _dot(qs_o, tl.trans(hi), IEEE) + bias[:, None]


@triton.jit
def _folded_values(codes_ptrs, nmask, vs_ptrs, vm_ptrs, p, MAGIC: tl.constexpr, IEEE: tl.constexpr,
                   dot_dtype: tl.constexpr):
    """p . (min + c x scale) over one sub-block and one group of channels, one (scale, min) per token:
    (p x scale) . c + p . min. Returns the even and odd channels' sums, [BLOCK_G, channels / 2] each."""
    codes = tl.load(codes_ptrs, mask=nmask[:, None], other=0)
    lo, hi = _codes_as_dot(codes, MAGIC, dot_dtype)
    pw = (p * tl.load(vs_ptrs, mask=nmask, other=0.0).to(tl.float32)[None, :]).to(dot_dtype)
    pm = tl.sum(p * tl.load(vm_ptrs, mask=nmask, other=0.0).to(tl.float32)[None, :], axis=1)
    if MAGIC:
        pm -= 128.0 * tl.sum(pw.to(tl.float32), axis=1)
    return _dot(pw, lo, IEEE) + pm[:, None], _dot(pw, hi, IEEE) + pm[:, None]


@triton.jit
def _folded_segment_kernel(
    q_ptr, k_ptr, ks_ptr, km_ptr, v_ptr, vs_ptr, vm_ptr, tk_ptr, tv_ptr, len_ptr, m_ptr, l_ptr, acc_ptr,
    N, H, G, split_tokens, split0, total_splits, sm_scale,
    s_kb, s_kh, s_kn, s_ksb, s_ksh, s_ksg, s_vb, s_vh, s_vn, s_vsb, s_vsh, s_vsn, s_tb,
    D: tl.constexpr, HALF: tl.constexpr, SUB_N: tl.constexpr, K_SUB: tl.constexpr, BLOCK_G: tl.constexpr,
    KGROUP: tl.constexpr, V_SUB: tl.constexpr, HAS_TOK: tl.constexpr, HAS_LEN: tl.constexpr, IEEE: tl.constexpr,
    MAGIC: tl.constexpr,
):
    """The 4-bit segment with its scales folded out of the loop (see :func:`_folded_scores` and
    :func:`_folded_values`). A loop block is K_SUB sub-blocks of SUB_N tokens, each inside one key group, under
    one online-softmax update; a token's channels are V_SUB groups, each with its own accumulators, so every
    product reads only its own group's codes (no product computed twice and half thrown away)."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // H
    hk = bh % H
    g = tl.arange(0, BLOCK_G)
    i = tl.arange(0, HALF)
    Q: tl.constexpr = HALF // V_SUB  # code bytes (channel pairs) per group of channels
    iq = tl.arange(0, Q)
    gmask = g < G
    q_rows = q_ptr + ((b * H + hk) * G + g)[:, None] * D
    q_even_f = tl.load(q_rows + 2 * i[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
    q_odd_f = tl.load(q_rows + 2 * i[None, :] + 1, mask=gmask[:, None], other=0.0).to(tl.float32)
    if IEEE:
        dot_dtype: tl.constexpr = tl.float32
    else:
        dot_dtype: tl.constexpr = tl.bfloat16
    n_end = N
    if HAS_LEN:
        n_end = tl.minimum(N, tl.load(len_ptr + b))
    start = split * split_tokens
    stop = tl.minimum(start + split_tokens, n_end)
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc_e0 = tl.zeros([BLOCK_G, Q], tl.float32)
    acc_o0 = tl.zeros([BLOCK_G, Q], tl.float32)
    acc_e1 = tl.zeros([BLOCK_G, Q], tl.float32)
    acc_o1 = tl.zeros([BLOCK_G, Q], tl.float32)
    k_base = k_ptr + b.to(tl.int64) * s_kb + hk.to(tl.int64) * s_kh
    v_base = v_ptr + b.to(tl.int64) * s_vb + hk.to(tl.int64) * s_vh
    ks_base = ks_ptr + b.to(tl.int64) * s_ksb + hk.to(tl.int64) * s_ksh
    km_base = km_ptr + b.to(tl.int64) * s_ksb + hk.to(tl.int64) * s_ksh
    vs_base = vs_ptr + b.to(tl.int64) * s_vsb + hk.to(tl.int64) * s_vsh
    vm_base = vm_ptr + b.to(tl.int64) * s_vsb + hk.to(tl.int64) * s_vsh
    scale = sm_scale * 1.4426950408889634
    for n0 in range(start, stop, SUB_N * K_SUB):
        na = n0 + tl.arange(0, SUB_N)
        ma = na < stop
        live_a = i < HALF  # the block starts before stop: its first group is read
        s_a = _folded_scores(k_base + na[:, None] * s_kn + i[None, :], ma, ks_base + (n0 // KGROUP) * s_ksg,
                             km_base + (n0 // KGROUP) * s_ksg, live_a, q_even_f, q_odd_f, i, MAGIC, IEEE, dot_dtype)
        valid_a = ma
        if HAS_TOK:
            tk_a = tl.load(tk_ptr + b.to(tl.int64) * s_tb + na, mask=ma, other=-1.0)
            valid_a = valid_a & (tk_a >= 0)
            s_a = s_a * tk_a[None, :]
        s_a = tl.where(valid_a[None, :], s_a * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s_a, axis=1))
        if K_SUB == 2:
            nb = na + SUB_N
            mb = nb < stop
            live_b = i < (n0 + SUB_N < stop).to(tl.int32) * HALF  # a group past the split's end: no read
            gb = (n0 + SUB_N) // KGROUP
            s_b = _folded_scores(k_base + nb[:, None] * s_kn + i[None, :], mb, ks_base + gb * s_ksg,
                                 km_base + gb * s_ksg, live_b, q_even_f, q_odd_f, i, MAGIC, IEEE, dot_dtype)
            valid_b = mb
            if HAS_TOK:
                tk_b = tl.load(tk_ptr + b.to(tl.int64) * s_tb + nb, mask=mb, other=-1.0)
                valid_b = valid_b & (tk_b >= 0)
                s_b = s_b * tk_b[None, :]
            s_b = tl.where(valid_b[None, :], s_b * scale, float("-inf"))
            m_new = tl.maximum(m_new, tl.max(s_b, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p_a = tl.exp2(s_a - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p_a, axis=1)
        if HAS_TOK:
            p_a = p_a * tl.load(tv_ptr + b.to(tl.int64) * s_tb + na, mask=ma, other=0.0)[None, :]
        acc_e0 = acc_e0 * alpha[:, None]
        acc_o0 = acc_o0 * alpha[:, None]
        e, o = _folded_values(v_base + na[:, None] * s_vn + iq[None, :], ma, vs_base + na * s_vsn,
                              vm_base + na * s_vsn, p_a, MAGIC, IEEE, dot_dtype)
        acc_e0 += e
        acc_o0 += o
        if V_SUB == 2:
            acc_e1 = acc_e1 * alpha[:, None]
            acc_o1 = acc_o1 * alpha[:, None]
            e, o = _folded_values(v_base + na[:, None] * s_vn + Q + iq[None, :], ma, vs_base + na * s_vsn + 1,
                                  vm_base + na * s_vsn + 1, p_a, MAGIC, IEEE, dot_dtype)
            acc_e1 += e
            acc_o1 += o
        if K_SUB == 2:
            p_b = tl.exp2(s_b - m_new[:, None])
            l_i += tl.sum(p_b, axis=1)
            if HAS_TOK:
                p_b = p_b * tl.load(tv_ptr + b.to(tl.int64) * s_tb + nb, mask=mb, other=0.0)[None, :]
            e, o = _folded_values(v_base + nb[:, None] * s_vn + iq[None, :], mb, vs_base + nb * s_vsn,
                                  vm_base + nb * s_vsn, p_b, MAGIC, IEEE, dot_dtype)
            acc_e0 += e
            acc_o0 += o
            if V_SUB == 2:
                e, o = _folded_values(v_base + nb[:, None] * s_vn + Q + iq[None, :], mb, vs_base + nb * s_vsn + 1,
                                      vm_base + nb * s_vsn + 1, p_b, MAGIC, IEEE, dot_dtype)
                acc_e1 += e
                acc_o1 += o
        m_i = m_new
    row = (b * H + hk) * G + g  # query head index over [b, hq]
    slot = row.to(tl.int64) * total_splits + split0 + split
    tl.store(m_ptr + slot, m_i, mask=gmask)
    tl.store(l_ptr + slot, l_i, mask=gmask)
    out = acc_ptr + slot[:, None] * D + 2 * iq[None, :]
    tl.store(out, acc_e0, mask=gmask[:, None])
    tl.store(out + 1, acc_o0, mask=gmask[:, None])
    if V_SUB == 2:
        tl.store(out + 2 * Q, acc_e1, mask=gmask[:, None])
        tl.store(out + 2 * Q + 1, acc_o1, mask=gmask[:, None])
