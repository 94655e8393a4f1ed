"""MiniCache's 4-bit decode partials with one product per group of scales (the folded path without waste).

With the scales folded (:mod:`neutrain.kernels.minicache_attention`: a key group's per-channel scales into the
query, a token's per-group value scales into p), each group of scales needs its own product. The folded loop of
``_segment_kernel`` takes every product over the whole block and keeps each group's part with a select: with
Llama-3's head dim 128 and KIVI groups of 64 (two groups of tokens in a 128-token block, two groups of channels
in a value row) it runs twice the key products and twice the value products the bytes need. On an H200 that block
cost 5.4 ms a layer at batch 51 and 64K tokens, against 3.4 ms with groups of 128 (one group a block and a row;
``minicache_decode_launch`` rows in ``benchmarks/kv/results.jsonl``).

Here each product covers only its group: the keys of a block are read as ``K_SUB`` tiles of one group of tokens
each (one online-softmax update over all of them), the values as ``V_SUB`` tiles of one group of channels, each
with its own accumulator. The math, the folds and the partial's format are ``_segment_kernel``'s. Up to two groups
each way (head dim 128 with groups of 64 or more); the caller keeps ``_segment_kernel`` for the rest.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .minicache_attention import _codes_as_dot


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _scores(q_even_f, q_odd_f, k_base, s_kn, scale_row, min_row, n, nmask, i, live,
            MAGIC: tl.constexpr, dot_dtype: tl.constexpr, IEEE: tl.constexpr):
    """[BLOCK_G, tokens] scores of the tokens ``n`` (one group of tokens: one scale and minimum a channel)."""
    codes = tl.load(k_base + n[:, None] * s_kn + i[None, :], mask=nmask[:, None], other=0)
    c_lo, c_hi = _codes_as_dot(codes, MAGIC, dot_dtype)
    qs_e = (q_even_f * tl.load(scale_row + 2 * i, mask=live, other=0.0).to(tl.float32)[None, :]).to(dot_dtype)
    qs_o = (q_odd_f * tl.load(scale_row + 2 * i + 1, mask=live, other=0.0).to(tl.float32)[None, :]).to(dot_dtype)
    bias = tl.sum(q_even_f * tl.load(min_row + 2 * i, mask=live, other=0.0).to(tl.float32)[None, :], axis=1)
    bias += tl.sum(q_odd_f * tl.load(min_row + 2 * i + 1, mask=live, other=0.0).to(tl.float32)[None, :], axis=1)
    if MAGIC:  # the codes were read as 128 + c: take the 128s back out
        bias -= 128.0 * (tl.sum(qs_e.to(tl.float32), axis=1) + tl.sum(qs_o.to(tl.float32), axis=1))
    return _dot(qs_e, tl.trans(c_lo), IEEE) + _dot(qs_o, tl.trans(c_hi), IEEE) + bias[:, None]


@triton.jit
def _values(p, v_base, s_vn, vs_ptr, vm_ptr, vrow, n, nmask, ic, j,
            MAGIC: tl.constexpr, dot_dtype: tl.constexpr, IEEE: tl.constexpr):
    """p . values of the tokens ``n`` over the channel pairs ``ic`` of value group ``j``: (even, odd) parts."""
    codes = tl.load(v_base + n[:, None] * s_vn + ic[None, :], mask=nmask[:, None], other=0)
    c_lo, c_hi = _codes_as_dot(codes, MAGIC, dot_dtype)
    pw = (p * tl.load(vs_ptr + vrow + j, mask=nmask, other=0.0).to(tl.float32)[None, :]).to(dot_dtype)
    pm = tl.sum(p * tl.load(vm_ptr + vrow + j, mask=nmask, other=0.0).to(tl.float32)[None, :], axis=1)
    if MAGIC:
        pm -= 128.0 * tl.sum(pw.to(tl.float32), axis=1)
    return _dot(pw, c_lo, IEEE) + pm[:, None], _dot(pw, c_hi, IEEE) + pm[:, None]


@triton.jit
def _probabilities(s, n, nmask, tk_ptr, tv_ptr, tok_row, sm_scale, HAS_TOK: tl.constexpr):
    """Scores to log2 units, masked (past the end, or a negative key factor), and the tokens' value factors."""
    valid = nmask
    tv = nmask.to(tl.float32) * 0.0 + 1.0  # no value factors: p as it is
    if HAS_TOK:
        tk = tl.load(tk_ptr + tok_row + n, mask=nmask, other=-1.0)
        tv = tl.load(tv_ptr + tok_row + n, mask=nmask, other=0.0)
        valid = valid & (tk >= 0)
        s = s * tk[None, :]
    s = s * (sm_scale * 1.4426950408889634)
    return tl.where(valid[None, :], s, float("-inf")), tv


@triton.jit
def group_tiles_kernel(
    q_ptr, k_ptr, ks_ptr, km_ptr, v_ptr, vs_ptr, vm_ptr, tk_ptr, tv_ptr, len_ptr, m_ptr, l_ptr, acc_ptr,
    N, H, G, split_tokens, split0, total_splits, sm_scale,
    s_kb, s_kh, s_kn, s_ksb, s_ksh, s_ksg, s_vb, s_vh, s_vn, s_vsb, s_vsh, s_vsn, s_tb,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
    KGROUP: tl.constexpr, HAS_TOK: tl.constexpr, HAS_LEN: tl.constexpr, IEEE: tl.constexpr,
    K_SUB: tl.constexpr, V_SUB: tl.constexpr, MAGIC: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // H
    hk = bh % H
    KT: tl.constexpr = BLOCK_N // K_SUB  # tokens of one key tile: one group of tokens when K_SUB is 2
    CH: tl.constexpr = HALF // V_SUB  # channel pairs of one value group
    g = tl.arange(0, BLOCK_G)
    i = tl.arange(0, HALF)
    t = tl.arange(0, KT)
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
    ic0 = tl.arange(0, CH)
    acc_e0 = tl.zeros([BLOCK_G, CH], tl.float32)
    acc_o0 = tl.zeros([BLOCK_G, CH], tl.float32)
    if V_SUB == 2:
        acc_e1 = tl.zeros([BLOCK_G, CH], tl.float32)
        acc_o1 = tl.zeros([BLOCK_G, CH], tl.float32)
    k_base = k_ptr + b.to(tl.int64) * s_kb + hk.to(tl.int64) * s_kh
    v_base = v_ptr + b.to(tl.int64) * s_vb + hk.to(tl.int64) * s_vh
    ks_base = b.to(tl.int64) * s_ksb + hk.to(tl.int64) * s_ksh
    vs_base = b.to(tl.int64) * s_vsb + hk.to(tl.int64) * s_vsh
    tok_row = b.to(tl.int64) * s_tb
    for n0 in range(start, stop, BLOCK_N):
        na = n0 + t
        ma = na < stop
        group = n0 // KGROUP
        live_a = i < HALF  # the block's first tile starts before the split's end: its group exists
        sa = _scores(q_even_f, q_odd_f, k_base, s_kn, ks_ptr + ks_base + group * s_ksg, km_ptr + ks_base + group * s_ksg,
                     na, ma, i, live_a, MAGIC, dot_dtype, IEEE)
        sa, tva = _probabilities(sa, na, ma, tk_ptr, tv_ptr, tok_row, sm_scale, HAS_TOK)
        m_new = tl.maximum(m_i, tl.max(sa, axis=1))
        if K_SUB == 2:
            nb = na + KT
            mb = nb < stop
            live_b = i < (n0 + KT < stop).to(tl.int32) * HALF  # a group past the split's end: no scale read
            sb = _scores(q_even_f, q_odd_f, k_base, s_kn, ks_ptr + ks_base + (group + 1) * s_ksg,
                         km_ptr + ks_base + (group + 1) * s_ksg, nb, mb, i, live_b, MAGIC, dot_dtype, IEEE)
            sb, tvb = _probabilities(sb, nb, mb, tk_ptr, tv_ptr, tok_row, sm_scale, HAS_TOK)
            m_new = tl.maximum(m_new, tl.max(sb, axis=1))
        alpha = tl.exp2(m_i - m_new)
        pa = tl.exp2(sa - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pa, axis=1)
        pa = pa * tva[None, :]
        acc_e0 = acc_e0 * alpha[:, None]
        acc_o0 = acc_o0 * alpha[:, None]
        a_e, a_o = _values(pa, v_base, s_vn, vs_ptr, vm_ptr, vs_base + na * s_vsn, na, ma, ic0, 0, MAGIC, dot_dtype,
                           IEEE)
        acc_e0 += a_e
        acc_o0 += a_o
        if V_SUB == 2:
            acc_e1 = acc_e1 * alpha[:, None]
            acc_o1 = acc_o1 * alpha[:, None]
            a_e, a_o = _values(pa, v_base, s_vn, vs_ptr, vm_ptr, vs_base + na * s_vsn, na, ma, ic0 + CH, 1, MAGIC,
                               dot_dtype, IEEE)
            acc_e1 += a_e
            acc_o1 += a_o
        if K_SUB == 2:
            pb = tl.exp2(sb - m_new[:, None])
            l_i += tl.sum(pb, axis=1)
            pb = pb * tvb[None, :]
            a_e, a_o = _values(pb, v_base, s_vn, vs_ptr, vm_ptr, vs_base + nb * s_vsn, nb, mb, ic0, 0, MAGIC,
                               dot_dtype, IEEE)
            acc_e0 += a_e
            acc_o0 += a_o
            if V_SUB == 2:
                a_e, a_o = _values(pb, v_base, s_vn, vs_ptr, vm_ptr, vs_base + nb * s_vsn, nb, mb, ic0 + CH, 1, MAGIC,
                                   dot_dtype, IEEE)
                acc_e1 += a_e
                acc_o1 += a_o
        m_i = m_new
    row = (b * H + hk) * G + g
    slot = row.to(tl.int64) * total_splits + split0 + split
    tl.store(m_ptr + slot, m_i, mask=gmask)
    tl.store(l_ptr + slot, l_i, mask=gmask)
    out = acc_ptr + slot[:, None] * D + 2 * ic0[None, :]
    tl.store(out, acc_e0, mask=gmask[:, None])
    tl.store(out + 1, acc_o0, mask=gmask[:, None])
    if V_SUB == 2:
        tl.store(out + 2 * CH, acc_e1, mask=gmask[:, None])
        tl.store(out + 2 * CH + 1, acc_o1, mask=gmask[:, None])
