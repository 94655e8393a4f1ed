"""Triton decode attention over MiniCache's compressed stores, read in place (split-K, GQA).

MiniCache's per-step read used to restore every merged or 4-bit layer to a bf16 copy (unpack,
convert, scale, concatenate, rescale): 15-20 bytes of traffic per element against the 2 a
full cache's attention reads, which made it slower than the full cache it compresses
(benchmarks/kv/NOTES.md). Here one new query token attends over a list of *segments*, each
read directly from the store it lives in:

* keys: bf16/fp32 rows, or 4-bit codes packed two per byte along the head dim with one
  (scale, minimum) per channel and group of ``key_group`` tokens (KIVI keys, ``axis="channel"``);
* values: rows, or 4-bit codes with one (scale, minimum) per token and group of
  ``value_group`` channels (KIVI values, ``axis="token"``);
* optionally a per-token factor for keys and for values (a merged layer's norm over its
  shared direction's norm: the restore of MiniCache's Eq. 2 is one multiply per token), a
  negative factor masking the token (a retained token, attended in its own segment);
* optionally a per-batch-row length (padded retained rows).

The codes are never interleaved: the even and odd channels of the query (and of the output)
are handled as two halves, each multiplied with one nibble of the codes. Each program reads one
(batch row, KV head) and a slice of tokens for the whole GQA group of query heads (padded to 16
rows for ``tl.dot``) and writes an online-softmax partial (max, sum, unnormalised output); one
combine kernel merges the partials of every slice of every segment. Nothing the size of the
cache is written.

The pure-PyTorch reference is :func:`neutrain.eval.kv.minicache_attention.decode_attention_reference`;
the segments are built by :mod:`neutrain.eval.kv.minicache_attention` from the cache's stores.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from . import interpreting
from .decode_combine import combine_partials

COUNTERS = {"segments": 0, "calls": 0}
"""Kernel launches (segment partials, combines), so tests can assert that the fast path ran."""

LOG2E = 1.4426950408889634


@triton.jit
def _codes_as_dot(codes, MAGIC: tl.constexpr, dot_dtype: tl.constexpr):
    """Low and high nibbles of packed 4-bit codes as a product's operand: c, or with MAGIC 128 + c, made by an OR
    into bf16's exponent bits (0x4300 | c is the bf16 of 128 + c, exact) instead of an int-to-float conversion per
    element; the caller takes the 128s back out through its sums (exact products, fp32 sums)."""
    if MAGIC:
        lo = ((codes & 15).to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True).to(dot_dtype)
        hi = ((codes >> 4).to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True).to(dot_dtype)
    else:
        lo = (codes & 15).to(dot_dtype)
        hi = (codes >> 4).to(dot_dtype)
    return lo, hi


@triton.jit
def _segment_kernel(
    q_ptr, k_ptr, ks_ptr, km_ptr, v_ptr, vs_ptr, vm_ptr, tk_ptr, tv_ptr, len_ptr, m_ptr, l_ptr, acc_ptr,
    N, H, G, split_tokens, split0, total_splits, sm_scale,
    s_kb, s_kh, s_kn, s_ksb, s_ksh, s_ksg, s_vb, s_vh, s_vn, s_vsb, s_vsh, s_vsn, s_tb,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
    K_QUANT: tl.constexpr, V_QUANT: tl.constexpr, KGROUP: tl.constexpr, VGROUP: tl.constexpr,
    HAS_TOK: tl.constexpr, HAS_LEN: tl.constexpr, IEEE: tl.constexpr,
    FOLD_K: tl.constexpr, K_SUB: tl.constexpr, FOLD_V: tl.constexpr, V_SUB: tl.constexpr, MAGIC: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // H
    hk = bh % H
    g = tl.arange(0, BLOCK_G)
    i = tl.arange(0, HALF)
    gmask = g < G
    # Query rows of this KV head's group, even and odd channels apart; log2(e) folded in for exp2.
    q_rows = q_ptr + ((b * H + hk) * G + g)[:, None] * D
    q_even = tl.load(q_rows + 2 * i[None, :], mask=gmask[:, None], other=0.0)
    q_odd = tl.load(q_rows + 2 * i[None, :] + 1, mask=gmask[:, None], other=0.0)
    if IEEE:
        dot_dtype: tl.constexpr = tl.float32
    else:
        dot_dtype: tl.constexpr = tl.bfloat16
    q_even_f = q_even.to(tl.float32)
    q_odd_f = q_odd.to(tl.float32)
    q_even = q_even.to(dot_dtype)
    q_odd = q_odd.to(dot_dtype)
    n_end = N
    if HAS_LEN:
        n_end = tl.minimum(N, tl.load(len_ptr + b))
    start = split * split_tokens
    stop = tl.minimum(start + split_tokens, n_end)
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc_even = tl.zeros([BLOCK_G, HALF], tl.float32)
    acc_odd = tl.zeros([BLOCK_G, HALF], tl.float32)
    k_base = k_ptr + b.to(tl.int64) * s_kb + hk.to(tl.int64) * s_kh
    v_base = v_ptr + b.to(tl.int64) * s_vb + hk.to(tl.int64) * s_vh
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < stop
        # -- keys [BLOCK_N, HALF] per parity
        if FOLD_K:
            # Within one group of tokens each channel's (scale, minimum) is one number:
            # q . (min + code * scale) = (q * scale) . code + q . min. The codes go to the tensor cores as they are
            # (0..15 are exact in bf16): no per-element multiply-add and no per-element scale loads. A block that
            # spans K_SUB groups takes one product per group and keeps each group's columns.
            codes = tl.load(k_base + n[:, None] * s_kn + i[None, :], mask=nmask[:, None], other=0)
            c_lo, c_hi = _codes_as_dot(codes, MAGIC, dot_dtype)  # the 128s come back out through the sums
            for j in tl.static_range(K_SUB):
                group = n0 // KGROUP + j
                live = i < (n0 + j * KGROUP < stop).to(tl.int32) * HALF  # a group past the split's end: no read
                grp = ks_ptr + b.to(tl.int64) * s_ksb + hk.to(tl.int64) * s_ksh + group * s_ksg
                gmin = km_ptr + b.to(tl.int64) * s_ksb + hk.to(tl.int64) * s_ksh + group * s_ksg
                qs_e = (q_even_f * tl.load(grp + 2 * i, mask=live, other=0.0).to(tl.float32)[None, :]).to(dot_dtype)
                qs_o = (q_odd_f * tl.load(grp + 2 * i + 1, mask=live, other=0.0).to(tl.float32)[None, :]).to(dot_dtype)
                bias = tl.sum(q_even_f * tl.load(gmin + 2 * i, mask=live, other=0.0).to(tl.float32)[None, :], axis=1)
                bias += tl.sum(q_odd_f * tl.load(gmin + 2 * i + 1, mask=live, other=0.0).to(tl.float32)[None, :], axis=1)
                if MAGIC:
                    bias -= 128.0 * (tl.sum(qs_e.to(tl.float32), axis=1) + tl.sum(qs_o.to(tl.float32), axis=1))
                if IEEE:
                    s_j = tl.dot(qs_e, tl.trans(c_lo), input_precision="ieee")
                    s_j += tl.dot(qs_o, tl.trans(c_hi), input_precision="ieee")
                else:
                    s_j = tl.dot(qs_e, tl.trans(c_lo))
                    s_j += tl.dot(qs_o, tl.trans(c_hi))
                s_j += bias[:, None]
                if K_SUB == 1:
                    s = s_j
                elif j == 0:
                    s = s_j
                else:
                    s = tl.where(((tl.arange(0, BLOCK_N) // KGROUP) == j)[None, :], s_j, s)
        elif K_QUANT:
            codes = tl.load(k_base + n[:, None] * s_kn + i[None, :], mask=nmask[:, None], other=0)
            if KGROUP % BLOCK_N == 0:  # the whole block in one group of tokens: one (scale, min) row per parity
                grp = ks_ptr + b.to(tl.int64) * s_ksb + hk.to(tl.int64) * s_ksh + (n0 // KGROUP) * s_ksg
                gmin = km_ptr + b.to(tl.int64) * s_ksb + hk.to(tl.int64) * s_ksh + (n0 // KGROUP) * s_ksg
                sc_e = tl.load(grp + 2 * i).to(tl.float32)[None, :]
                sc_o = tl.load(grp + 2 * i + 1).to(tl.float32)[None, :]
                mn_e = tl.load(gmin + 2 * i).to(tl.float32)[None, :]
                mn_o = tl.load(gmin + 2 * i + 1).to(tl.float32)[None, :]
            else:
                grp = (n // KGROUP)[:, None] * s_ksg
                ks = ks_ptr + b.to(tl.int64) * s_ksb + hk.to(tl.int64) * s_ksh + grp
                km = km_ptr + b.to(tl.int64) * s_ksb + hk.to(tl.int64) * s_ksh + grp
                sc_e = tl.load(ks + 2 * i[None, :], mask=nmask[:, None], other=0.0).to(tl.float32)
                sc_o = tl.load(ks + 2 * i[None, :] + 1, mask=nmask[:, None], other=0.0).to(tl.float32)
                mn_e = tl.load(km + 2 * i[None, :], mask=nmask[:, None], other=0.0).to(tl.float32)
                mn_o = tl.load(km + 2 * i[None, :] + 1, mask=nmask[:, None], other=0.0).to(tl.float32)
            k_even = mn_e + (codes & 15).to(tl.float32) * sc_e
            k_odd = mn_o + (codes >> 4).to(tl.float32) * sc_o
        else:
            rows = k_base + n[:, None] * s_kn + 2 * i[None, :]
            k_even = tl.load(rows, mask=nmask[:, None], other=0.0)
            k_odd = tl.load(rows + 1, mask=nmask[:, None], other=0.0)
        if not FOLD_K:
            if IEEE:
                s = tl.dot(q_even, tl.trans(k_even.to(dot_dtype)), input_precision="ieee")
                s += tl.dot(q_odd, tl.trans(k_odd.to(dot_dtype)), input_precision="ieee")
            else:
                s = tl.dot(q_even, tl.trans(k_even.to(dot_dtype)))
                s += tl.dot(q_odd, tl.trans(k_odd.to(dot_dtype)))
        valid = nmask
        if HAS_TOK:
            tk = tl.load(tk_ptr + b.to(tl.int64) * s_tb + n, mask=nmask, other=-1.0)
            tv = tl.load(tv_ptr + b.to(tl.int64) * s_tb + n, mask=nmask, other=0.0)
            valid = valid & (tk >= 0)
            s = s * tk[None, :]
        s = s * (sm_scale * 1.4426950408889634)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if HAS_TOK:
            p = p * tv[None, :]
        pd = p.to(dot_dtype)
        acc_even = acc_even * alpha[:, None]
        acc_odd = acc_odd * alpha[:, None]
        # -- values [BLOCK_N, HALF] per parity
        if FOLD_V:
            # One (scale, minimum) per token and group of channels: p . (min + code * scale) =
            # (p * scale) . code + p . min, one product per group of channels, each keeping its channels.
            codes = tl.load(v_base + n[:, None] * s_vn + i[None, :], mask=nmask[:, None], other=0)
            c_lo, c_hi = _codes_as_dot(codes, MAGIC, dot_dtype)
            vrow = b.to(tl.int64) * s_vsb + hk.to(tl.int64) * s_vsh + n * s_vsn
            for j in tl.static_range(V_SUB):
                pw = (p * tl.load(vs_ptr + vrow + j, mask=nmask, other=0.0).to(tl.float32)[None, :]).to(dot_dtype)
                pm = tl.sum(p * tl.load(vm_ptr + vrow + j, mask=nmask, other=0.0).to(tl.float32)[None, :], axis=1)
                if MAGIC:
                    pm -= 128.0 * tl.sum(pw.to(tl.float32), axis=1)
                if IEEE:
                    a_e = tl.dot(pw, c_lo, input_precision="ieee") + pm[:, None]
                    a_o = tl.dot(pw, c_hi, input_precision="ieee") + pm[:, None]
                else:
                    a_e = tl.dot(pw, c_lo) + pm[:, None]
                    a_o = tl.dot(pw, c_hi) + pm[:, None]
                if V_SUB == 1:
                    acc_even += a_e
                    acc_odd += a_o
                else:  # even channel 2i and odd 2i + 1 share a group (groups are even)
                    mine = ((2 * i) // VGROUP == j)[None, :]
                    acc_even += tl.where(mine, a_e, 0.0)
                    acc_odd += tl.where(mine, a_o, 0.0)
        elif V_QUANT:
            codes = tl.load(v_base + n[:, None] * s_vn + i[None, :], mask=nmask[:, None], other=0)
            vrow = vs_ptr + b.to(tl.int64) * s_vsb + hk.to(tl.int64) * s_vsh + n[:, None] * s_vsn
            vmin = vm_ptr + b.to(tl.int64) * s_vsb + hk.to(tl.int64) * s_vsh + n[:, None] * s_vsn
            ge = ((2 * i) // VGROUP)[None, :]
            go = ((2 * i + 1) // VGROUP)[None, :]
            v_even = tl.load(vmin + ge, mask=nmask[:, None], other=0.0).to(tl.float32) + (codes & 15).to(
                tl.float32) * tl.load(vrow + ge, mask=nmask[:, None], other=0.0).to(tl.float32)
            v_odd = tl.load(vmin + go, mask=nmask[:, None], other=0.0).to(tl.float32) + (codes >> 4).to(
                tl.float32) * tl.load(vrow + go, mask=nmask[:, None], other=0.0).to(tl.float32)
        else:
            rows = v_base + n[:, None] * s_vn + 2 * i[None, :]
            v_even = tl.load(rows, mask=nmask[:, None], other=0.0)
            v_odd = tl.load(rows + 1, mask=nmask[:, None], other=0.0)
        if not FOLD_V:
            if IEEE:
                acc_even += tl.dot(pd, v_even.to(dot_dtype), input_precision="ieee")
                acc_odd += tl.dot(pd, v_odd.to(dot_dtype), input_precision="ieee")
            else:
                acc_even += tl.dot(pd, v_even.to(dot_dtype))
                acc_odd += tl.dot(pd, v_odd.to(dot_dtype))
        m_i = m_new
    row = (b * H + hk) * G + g  # query head index over [b, hq]
    slot = row.to(tl.int64) * total_splits + split0 + split
    tl.store(m_ptr + slot, m_i, mask=gmask)
    tl.store(l_ptr + slot, l_i, mask=gmask)
    out = acc_ptr + slot[:, None] * D + 2 * i[None, :]
    tl.store(out, acc_even, mask=gmask[:, None])
    tl.store(out + 1, acc_odd, mask=gmask[:, None])


@dataclasses.dataclass(frozen=True)
class DecodeLaunch:
    """How a segment's partials are launched: tokens per loop block and warps (4-bit codes, plain rows), the
    software-pipeline depth, and how many programs per SM the token splits aim for.

    The 4-bit defaults are the fastest of ``benchmarks/kv/minicache_decode_launch.py`` on an H200 (one layer,
    batch 51, 64K tokens: 3.43 ms with the folds, against 8.41 ms for the dequantizing loop at 32 tokens / 4
    warps / 2 programs per SM, and 3.26 ms for cuDNN's SDPA over the same tokens in bf16); plain rows keep 64
    tokens / 8 warps (80 registers, read off the sm_90 SASS).
    """

    quant_block: int = 128
    quant_warps: int = 4
    rows_block: int = 64
    rows_warps: int = 8
    stages: int | None = 4  # None: Triton's default
    programs_per_sm: int = 32
    fold_scales: bool = True  # a group's key scales into the query, a token's value scale into p (see the kernel)
    magic_codes: bool = True  # folded codes to bf16 by an OR (128 + c), not an int-to-float conversion


DEFAULT_LAUNCH = DecodeLaunch()


@functools.lru_cache(maxsize=None)
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _splits(n: int, rows: int, block: int, programs_per_sm: int = 2) -> tuple[int, int]:
    """``(tokens per split, splits)``: enough programs to fill the GPU (``programs_per_sm`` per SM) at a one-token
    query, where a (batch row, KV head) alone gives too few (224 at batch 28 on 132 SMs)."""
    if interpreting():
        per = max(block, triton.cdiv(n, 2))  # two slices on the interpreter: the combine is exercised
    else:
        sms = _sm_count(torch.cuda.current_device())
        want = max(1, triton.cdiv(programs_per_sm * sms, rows))
        per = max(4 * block, triton.cdiv(n, want))
    per = triton.cdiv(per, block) * block
    return per, max(1, triton.cdiv(n, per))


def folds(seg, block_n: int, d: int) -> tuple[bool, bool]:
    """Whether the kernel folds ``seg``'s key scales and its value scales out of the loop at ``block_n`` tokens a
    block. The folds need whole groups: a block inside one group of tokens or a few whole groups (keys), a token's
    channels in a few whole even groups (values); otherwise the loop dequantizes per element."""
    kg, vg = seg.key_group, seg.value_group
    fold_k = seg.key_scale is not None and (kg % block_n == 0 or (block_n % kg == 0 and block_n // kg <= 4))
    fold_v = seg.value_scale is not None and vg % 2 == 0 and d % vg == 0 and d // vg <= 4
    return fold_k, fold_v


def decode_attention(query: torch.Tensor, segments, scaling: float, launch: DecodeLaunch = DEFAULT_LAUNCH) -> torch.Tensor:
    """Attention of one query token per row over ``segments``, read as stored.

    Args:
        query: [b, hq, d] (``hq`` a multiple of the segments' KV heads).
        segments: objects with the attributes of
            :class:`neutrain.eval.kv.minicache_attention.Segment` (keys, values, their 4-bit scales and
            minima or None, key_group, value_group, key_token_scale, value_token_scale, lengths).
        scaling: Softmax scale.
        launch: Block sizes, warps, pipeline depth and split target (:class:`DecodeLaunch`).

    Returns:
        [b, hq, d] in ``query``'s dtype.

    Example (one segment of plain rows: the softmax attention of each query head over them):
        >>> from types import SimpleNamespace
        >>> k, v = torch.randn(1, 2, 40, 32), torch.randn(1, 2, 40, 32)
        >>> seg = SimpleNamespace(keys=k, values=v, key_scale=None, key_min=None, value_scale=None,
        ...                       value_min=None, key_group=1, value_group=1, key_token_scale=None,
        ...                       value_token_scale=None, lengths=None)
        >>> q = torch.randn(1, 4, 32)
        >>> out = decode_attention(q, [seg], 0.2)  # Triton: compiled on CUDA, its CPU interpreter in the tests
        >>> expect = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, scale=0.2, enable_gqa=True)
        >>> torch.allclose(out, expect[:, :, 0], atol=1e-5)
        True
    """
    b, hq, d = query.shape
    if not interpreting() and d < 32:
        raise ValueError(f"head dim {d} < 32: tl.dot needs >= 16 channels per parity half on the GPU")
    h = segments[0].values.shape[1]
    G = hq // h
    q = query.contiguous()
    block_g = 16 if interpreting() else max(16, triton.next_power_of_2(G))
    shapes = [(16, 4) if interpreting() else (launch.quant_block, launch.quant_warps) if seg.key_scale is not None
              else (launch.rows_block, launch.rows_warps) for seg in segments]
    plans = [_splits(seg.values.shape[2], b * h, block, launch.programs_per_sm) for seg, (block, _) in zip(segments, shapes)]
    stages = {} if launch.stages is None else {"num_stages": launch.stages}
    total = sum(n for _, n in plans)
    m = torch.empty(b, hq, total, dtype=torch.float32, device=q.device)
    l_ = torch.empty_like(m)
    acc = torch.empty(b, hq, total, d, dtype=torch.float32, device=q.device)
    ieee = q.dtype == torch.float32
    offset = 0
    for seg, (per, n_splits), (block_n, warps) in zip(segments, plans, shapes):
        k, v = seg.keys, seg.values
        k_quant, v_quant = seg.key_scale is not None, seg.value_scale is not None
        ks = seg.key_scale if k_quant else k  # unused pointers when not quantized: any tensor will do
        km = seg.key_min if k_quant else k
        vs = seg.value_scale if v_quant else v
        vm = seg.value_min if v_quant else v
        tok = seg.key_token_scale is not None
        tk = seg.key_token_scale if tok else m
        tv = seg.value_token_scale if tok else m
        lens = seg.lengths if seg.lengths is not None else m
        assert k.stride(-1) == 1 and v.stride(-1) == 1, "rows must be contiguous along the head dim"
        if k_quant:
            assert ks.is_contiguous() and km.is_contiguous()
        if v_quant:
            assert vs.is_contiguous() and vm.is_contiguous()
        ks_strides = (ks.stride(0), ks.stride(1), ks.stride(2)) if k_quant else (0, 0, 0)
        vs_strides = (vs.stride(0), vs.stride(1), vs.stride(2)) if v_quant else (0, 0, 0)
        tb = tk.stride(0) if tok else 0
        fold_k, fold_v = folds(seg, block_n, d) if launch.fold_scales else (False, False)
        _segment_kernel[(b * h, n_splits)](
            q, k, ks, km, v, vs, vm, tk, tv, lens, m, l_, acc,
            v.shape[2], h, G, per, offset, total, scaling,
            k.stride(0), k.stride(1), k.stride(2), *ks_strides, v.stride(0), v.stride(1), v.stride(2), *vs_strides, tb,
            D=d, HALF=d // 2, BLOCK_N=block_n, BLOCK_G=block_g, K_QUANT=k_quant, V_QUANT=v_quant,
            KGROUP=seg.key_group, VGROUP=seg.value_group, HAS_TOK=tok, HAS_LEN=seg.lengths is not None, IEEE=ieee,
            FOLD_K=fold_k, K_SUB=max(1, block_n // seg.key_group), FOLD_V=fold_v, V_SUB=max(1, d // seg.value_group),
            MAGIC=launch.magic_codes, num_warps=warps, **stages,
        )
        COUNTERS["segments"] += 1
        offset += n_splits
    out = torch.empty(b, hq, d, dtype=query.dtype, device=q.device)
    combine_partials(m.view(b * hq, total), l_.view(b * hq, total), acc.view(b * hq, total, d), out.view(b * hq, d))
    COUNTERS["calls"] += 1
    return out
