"""MiniCache's 4-bit decode partials with the tokens as the products' long side (a launch variant).

:mod:`neutrain.kernels.minicache_attention` multiplies the GQA group's query rows (4 for Llama-3, padded to 16 for
``tl.dot``) by a block of tokens: the short side is the M of the product, and on Hopper a product with M = 16
cannot be a warpgroup MMA (M = 64 at least), so it runs as Ampere-style MMAs whose operands are shuffled into
place through shared memory every block. Here the same products are taken transposed: scores^T = codes . q^T
(M = the block's tokens) and output^T = codes^T . p^T (M = the head's half width, 64). The codes, unpacked in
registers, are the A operand, which a warpgroup MMA reads from registers; only the small q^T and p^T go through
shared memory. The math, the folds of the scales and the partial's format are those of ``_segment_kernel``
(whose docstrings say why); only the orientation differs. It serves segments whose keys and values are both
4-bit with both folds possible; the caller keeps ``_segment_kernel`` for the rest.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .minicache_attention import _codes_as_dot


@triton.jit
def tokens_major_kernel(
    q_ptr, k_ptr, ks_ptr, km_ptr, v_ptr, vs_ptr, vm_ptr, tk_ptr, tv_ptr, len_ptr, m_ptr, l_ptr, acc_ptr,
    N, H, G, split_tokens, split0, total_splits, sm_scale,
    s_kb, s_kh, s_kn, s_ksb, s_ksh, s_ksg, s_vb, s_vh, s_vn, s_vsb, s_vsh, s_vsn, s_tb,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
    KGROUP: tl.constexpr, VGROUP: tl.constexpr, HAS_TOK: tl.constexpr, HAS_LEN: tl.constexpr, IEEE: tl.constexpr,
    K_SUB: tl.constexpr, V_SUB: tl.constexpr, MAGIC: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // H
    hk = bh % H
    g = tl.arange(0, BLOCK_G)
    i = tl.arange(0, HALF)
    t = tl.arange(0, BLOCK_N)
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
    acc_even = tl.zeros([HALF, BLOCK_G], tl.float32)  # transposed: channels x query rows
    acc_odd = tl.zeros([HALF, BLOCK_G], tl.float32)
    k_base = k_ptr + b.to(tl.int64) * s_kb + hk.to(tl.int64) * s_kh
    v_base = v_ptr + b.to(tl.int64) * s_vb + hk.to(tl.int64) * s_vh
    ks_base = b.to(tl.int64) * s_ksb + hk.to(tl.int64) * s_ksh
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + t
        nmask = n < stop
        codes = tl.load(k_base + n[:, None] * s_kn + i[None, :], mask=nmask[:, None], other=0)
        c_lo, c_hi = _codes_as_dot(codes, MAGIC, dot_dtype)  # [BLOCK_N, HALF]
        for j in tl.static_range(K_SUB):
            group = n0 // KGROUP + j
            live = i < (n0 + j * KGROUP < stop).to(tl.int32) * HALF
            grp = ks_ptr + ks_base + group * s_ksg
            gmin = km_ptr + ks_base + group * s_ksg
            qs_e = (q_even_f * tl.load(grp + 2 * i, mask=live, other=0.0).to(tl.float32)[None, :]).to(dot_dtype)
            qs_o = (q_odd_f * tl.load(grp + 2 * i + 1, mask=live, other=0.0).to(tl.float32)[None, :]).to(dot_dtype)
            bias = tl.sum(q_even_f * tl.load(gmin + 2 * i, mask=live, other=0.0).to(tl.float32)[None, :], axis=1)
            bias += tl.sum(q_odd_f * tl.load(gmin + 2 * i + 1, mask=live, other=0.0).to(tl.float32)[None, :], axis=1)
            if MAGIC:
                bias -= 128.0 * (tl.sum(qs_e.to(tl.float32), axis=1) + tl.sum(qs_o.to(tl.float32), axis=1))
            if IEEE:
                s_j = tl.dot(c_lo, tl.trans(qs_e), input_precision="ieee")
                s_j += tl.dot(c_hi, tl.trans(qs_o), input_precision="ieee")
            else:
                s_j = tl.dot(c_lo, tl.trans(qs_e))
                s_j += tl.dot(c_hi, tl.trans(qs_o))
            s_j += bias[None, :]  # [BLOCK_N, BLOCK_G]
            if K_SUB == 1:
                s = s_j
            elif j == 0:
                s = s_j
            else:
                s = tl.where(((t // KGROUP) == j)[:, None], s_j, s)
        valid = nmask
        if HAS_TOK:
            tk = tl.load(tk_ptr + b.to(tl.int64) * s_tb + n, mask=nmask, other=-1.0)
            tv = tl.load(tv_ptr + b.to(tl.int64) * s_tb + n, mask=nmask, other=0.0)
            valid = valid & (tk >= 0)
            s = s * tk[:, None]
        s = s * (sm_scale * 1.4426950408889634)
        s = tl.where(valid[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])  # [BLOCK_N, BLOCK_G]
        l_i = l_i * alpha + tl.sum(p, axis=0)
        if HAS_TOK:
            p = p * tv[:, None]
        acc_even = acc_even * alpha[None, :]
        acc_odd = acc_odd * alpha[None, :]
        vcodes = tl.load(v_base + n[:, None] * s_vn + i[None, :], mask=nmask[:, None], other=0)
        v_lo, v_hi = _codes_as_dot(vcodes, MAGIC, dot_dtype)
        v_lo_t = tl.trans(v_lo)  # [HALF, BLOCK_N]
        v_hi_t = tl.trans(v_hi)
        vrow = b.to(tl.int64) * s_vsb + hk.to(tl.int64) * s_vsh + n * s_vsn
        for j in tl.static_range(V_SUB):
            pw = (p * tl.load(vs_ptr + vrow + j, mask=nmask, other=0.0).to(tl.float32)[:, None]).to(dot_dtype)
            pm = tl.sum(p * tl.load(vm_ptr + vrow + j, mask=nmask, other=0.0).to(tl.float32)[:, None], axis=0)
            if MAGIC:
                pm -= 128.0 * tl.sum(pw.to(tl.float32), axis=0)
            if IEEE:
                a_e = tl.dot(v_lo_t, pw, input_precision="ieee") + pm[None, :]
                a_o = tl.dot(v_hi_t, pw, input_precision="ieee") + pm[None, :]
            else:
                a_e = tl.dot(v_lo_t, pw) + pm[None, :]
                a_o = tl.dot(v_hi_t, pw) + pm[None, :]
            if V_SUB == 1:
                acc_even += a_e
                acc_odd += a_o
            else:
                mine = ((2 * i) // VGROUP == j)[:, None]
                acc_even += tl.where(mine, a_e, 0.0)
                acc_odd += tl.where(mine, a_o, 0.0)
        m_i = m_new
    row = (b * H + hk) * G + g
    slot = row.to(tl.int64) * total_splits + split0 + split
    tl.store(m_ptr + slot, m_i, mask=gmask)
    tl.store(l_ptr + slot, l_i, mask=gmask)
    out = acc_ptr + slot[None, :] * D + 2 * i[:, None]
    tl.store(out, acc_even, mask=gmask[None, :])
    tl.store(out + 1, acc_odd, mask=gmask[None, :])
