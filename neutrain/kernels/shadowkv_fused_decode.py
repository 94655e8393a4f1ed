"""Triton decode attention for ShadowKV: the low-rank keys rebuilt inside the attention, one launch a layer.

ShadowKV's unfused decode step launches, for each layer, the key rebuild (``U[tokens] @ SV``, then RoPE), the
concatenations of ``[outliers | selected | tail]`` and SDPA: the rebuilt keys of every selected token go to HBM
and come back, and each of those is a kernel group launched from Python (on the H200 at 64K, batch 32, the
rebuild and the attention were 74 of a step's 131 ms; benchmarks/kv/NOTES.md). Here one program takes one
(batch row, KV head), one slice of its selected tokens, and the whole GQA group of query heads (padded to 16 rows
for ``tl.dot``) and runs one online softmax over three segments (the outliers in the first slice, the tail in
the last); with more than one slice each writes its partial and :mod:`neutrain.kernels.decode_combine` merges
them. Why slices: one program a (row, head) is 168 programs at 64K and batch 21 on 132 SMs, each walking 1,024
tokens alone, and the kernel read its ~57 MB a layer at ~0.17 TB/s on an H200 (329 us a layer):

* the outlier chunks' exact keys and values, ``[b, h, O, d]``;
* the selected chunks: for each block of their tokens, the rows of ``U`` ([b, n, r], shared by the heads) times
  the head's ``SV`` ([b, h, r, d]) in fp32, RoPE at the token's original position (cos/sin from the rotary
  module's ``inv_freq`` in fp32, times its ``attention_scaling``), then the scores; the keys live in registers
  only. Their values come already gathered, ``[b, h, k * chunk, d]``, or are read from where they are stored
  (``value_stores``): the first rows' from pinned host memory over PCIe (the chunk-major store the gather kernel
  of :mod:`neutrain.kernels.shadowkv` reads; the same layout per (row, head) as ``[ctx, d]``), the others' from
  the device. Why: a separate gather must finish before the attention starts, while reads inside the kernel
  overlap the other programs' key rebuilds;
* the tail (local window and generated tokens) read from a fixed-capacity buffer up to a length held on the
  device, so that nothing about the step depends on a host-side length (a CUDA graph can replay it).

The head dim is handled as its two halves, which is what RoPE's ``rotate_half`` pairs: the rebuilt key's halves
``lo``/``hi`` become ``lo*cos - hi*sin`` and ``hi*cos + lo*sin``, and the scores are ``q_lo.k_lo + q_hi.k_hi``.

The pure-PyTorch reference is :func:`neutrain.eval.kv.shadowkv_math.shadowkv_fused_decode_reference`;
:class:`neutrain.eval.kv.shadowkv.ShadowKVCache` uses this kernel with ``fused_decode=True``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting
from .decode_combine import combine_partials

COUNTERS = {"shadowkv_fused_decode": 0}
"""Kernel launches, so tests can assert that the fast path ran."""


@triton.jit
def _softmax_step(s, valid, v, m_i, l_i, acc, IEEE: tl.constexpr):
    """One block of scores ``s`` [G, N] (log2 units) and values ``v`` [N, D] into the running (max, sum, output)."""
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if IEEE:
        acc += tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc += tl.dot(p.to(tl.bfloat16), v.to(tl.bfloat16))
    return m_new, l_i, acc


@triton.jit
def _scores(q_lo, q_hi, k_lo, k_hi, IEEE: tl.constexpr):
    if IEEE:
        s = tl.dot(q_lo, tl.trans(k_lo.to(tl.float32)), input_precision="ieee")
        s += tl.dot(q_hi, tl.trans(k_hi.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q_lo, tl.trans(k_lo.to(tl.bfloat16)))
        s += tl.dot(q_hi, tl.trans(k_hi.to(tl.bfloat16)))
    return s


@triton.jit
def _dense_segment(q_lo, q_hi, k_base, v_base, length, m_i, l_i, acc,
                   D: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Exact rows ``[length, D]`` at ``k_base``/``v_base`` (contiguous)."""
    i = tl.arange(0, HALF)
    dd = tl.arange(0, D)
    for n0 in range(0, length, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < length
        rows = k_base + n[:, None].to(tl.int64) * D
        k_lo = tl.load(rows + i[None, :], mask=nmask[:, None], other=0.0)
        k_hi = tl.load(rows + HALF + i[None, :], mask=nmask[:, None], other=0.0)
        s = _scores(q_lo, q_hi, k_lo, k_hi, IEEE)
        v = tl.load(v_base + n[:, None].to(tl.int64) * D + dd[None, :], mask=nmask[:, None], other=0.0)
        m_i, l_i, acc = _softmax_step(s, nmask, v, m_i, l_i, acc, IEEE)
    return m_i, l_i, acc


@triton.jit
def _shadowkv_fused_decode_kernel(
    q_ptr, u_ptr, sv_ptr, ids_ptr, vsel_ptr, vh_ptr, ok_ptr, ov_ptr, tk_ptr, tv_ptr, tail_len_ptr, pos0_ptr,
    inv_freq_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, H, G, K, O, N, R, CAP, B_HOST, CTX, s_pos0, rope_scale, qk_scale,
    PER, SPLITS,
    CS: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_R: tl.constexpr, IEEE: tl.constexpr, FROM_STORE: tl.constexpr, SPLIT: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)  # which slice of the selected tokens (PER a slice); with SPLIT, partials out
    b = bh // H
    g = tl.arange(0, BLOCK_G)
    i = tl.arange(0, HALF)
    dd = tl.arange(0, D)
    gmask = g < G
    q_rows = q_ptr + (bh * G + g).to(tl.int64)[:, None] * D
    # the softmax scale and log2(e) folded into the query: the loop's scores are in log2 units
    q_lo = (tl.load(q_rows + i[None, :], mask=gmask[:, None], other=0.0).to(tl.float32) * qk_scale)
    q_hi = (tl.load(q_rows + HALF + i[None, :], mask=gmask[:, None], other=0.0).to(tl.float32) * qk_scale)
    if not IEEE:
        q_lo = q_lo.to(tl.bfloat16)
        q_hi = q_hi.to(tl.bfloat16)
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)

    # -- outlier chunks, exact (the first slice's)
    if split == 0:
        base = bh.to(tl.int64) * O * D
        m_i, l_i, acc = _dense_segment(q_lo, q_hi, ok_ptr + base, ov_ptr + base, O, m_i, l_i, acc, D, HALF, BLOCK_N,
                                       IEEE)

    # -- selected chunks, keys rebuilt from U and SV, RoPE at their original positions
    u_base = u_ptr + b.to(tl.int64) * N * R
    sv_base = sv_ptr + bh.to(tl.int64) * R * D
    if FROM_STORE:  # rows below B_HOST in the host store, the rest in the device store, both [CTX, D] a head
        if b < B_HOST:
            v_base = vh_ptr + bh.to(tl.int64) * CTX * D
        else:
            v_base = vsel_ptr + (bh - B_HOST * H).to(tl.int64) * CTX * D
    else:
        v_base = vsel_ptr + bh.to(tl.int64) * K * CS * D
    pos0 = tl.load(pos0_ptr + b * s_pos0)
    inv_freq = tl.load(inv_freq_ptr + i)
    stop = tl.minimum((split + 1) * PER, K * CS)
    for n0 in range(split * PER, stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < stop
        chunk = tl.load(ids_ptr + bh.to(tl.int64) * K + n // CS, mask=nmask, other=0).to(tl.int64)
        tok = chunk * CS + n % CS
        lo = tl.zeros([BLOCK_N, HALF], tl.float32)
        hi = tl.zeros([BLOCK_N, HALF], tl.float32)
        for r0 in range(0, R, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            rmask = r < R
            u = tl.load(u_base + tok[:, None] * R + r[None, :], mask=nmask[:, None] & rmask[None, :], other=0.0)
            sv_rows = sv_base + r[:, None] * D
            sv_lo = tl.load(sv_rows + i[None, :], mask=rmask[:, None], other=0.0)
            sv_hi = tl.load(sv_rows + HALF + i[None, :], mask=rmask[:, None], other=0.0)
            if IEEE:
                lo += tl.dot(u.to(tl.float32), sv_lo.to(tl.float32), input_precision="ieee")
                hi += tl.dot(u.to(tl.float32), sv_hi.to(tl.float32), input_precision="ieee")
            else:
                lo += tl.dot(u, sv_lo)
                hi += tl.dot(u, sv_hi)
        angle = (tok + pos0).to(tl.float32)[:, None] * inv_freq[None, :]
        cos = tl.cos(angle) * rope_scale
        sin = tl.sin(angle) * rope_scale
        k_lo = lo * cos - hi * sin
        k_hi = hi * cos + lo * sin
        s = _scores(q_lo, q_hi, k_lo, k_hi, IEEE)
        if FROM_STORE:
            v_row = tok
        else:
            v_row = n.to(tl.int64)
        v = tl.load(v_base + v_row[:, None] * D + dd[None, :], mask=nmask[:, None], other=0.0)
        m_i, l_i, acc = _softmax_step(s, nmask, v, m_i, l_i, acc, IEEE)

    # -- tail: local window and generated tokens, up to the device-held length (the last slice's)
    if split == SPLITS - 1:
        base = bh.to(tl.int64) * CAP * D
        tail = tl.load(tail_len_ptr)
        m_i, l_i, acc = _dense_segment(q_lo, q_hi, tk_ptr + base, tv_ptr + base, tail, m_i, l_i, acc,
                                       D, HALF, BLOCK_N, IEEE)

    row = (bh * G + g).to(tl.int64)
    if SPLIT:  # this slice's (max, sum, unnormalised output): decode_combine merges the slices
        slot = row * SPLITS + split
        tl.store(m_ptr + slot, m_i, mask=gmask)
        tl.store(l_ptr + slot, l_i, mask=gmask)
        tl.store(acc_ptr + slot[:, None] * D + dd[None, :], acc, mask=gmask[:, None])
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + row[:, None] * D + dd[None, :], out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


def shadowkv_fused_decode(query, u, sv, chunk_ids, values_sel, outlier_k, outlier_v, tail_k, tail_v, tail_len,
                          pos0, rotary, chunk_size: int, scaling: float, value_stores=None, out=None,
                          splits: int | None = None) -> torch.Tensor:
    """Attention of one query token per row over outliers, rebuilt selected chunks and the tail.

    Args:
        query: [b, hq, d] (``hq`` a multiple of the KV heads ``h``).
        u, sv: The low-rank pre-RoPE keys, [b, n, r] and [b, h, r, d].
        chunk_ids: [b, h, k] selected chunk ids (token ``c * chunk_size + j`` for ``j < chunk_size``).
        values_sel: [b, h, k * chunk_size, d], the selected chunks' values in ``chunk_ids``' order (None with
            ``value_stores``).
        outlier_k, outlier_v: [b, h, O, d].
        tail_k, tail_v: [b, h, capacity, d]; the first ``tail_len`` positions are attended.
        tail_len: int32 tensor [1] on the device (or None: the whole capacity).
        pos0: [1 or b, 1] position of each row's first token (RoPE positions are ``token + pos0``).
        rotary: the model's rotary module (``inv_freq``, ``attention_scaling``).
        scaling: Softmax scale.
        value_stores: ``(host, device)``: read the selected values from their stores instead of ``values_sel``:
            ``host`` [b_host, h, chunks, chunk_size * d] for the first ``b_host`` rows (pinned host memory on
            CUDA), ``device`` [b - b_host, h, chunks * chunk_size, d] for the rest; either may be None. Both
            must be contiguous (never copied here: the host store is the whole context's values).
        splits: slices of the selected tokens, each its own program per (row, head), merged by
            :func:`neutrain.kernels.decode_combine.combine_partials` (None: as many as fill the GPU,
            :func:`token_splits`; 1 on the interpreter).

    Returns:
        [b, hq, d] in ``query``'s dtype (written into ``out`` when given).
    """
    b, hq, d = query.shape
    h, k = chunk_ids.shape[1], chunk_ids.shape[2]
    n, r = u.shape[1], u.shape[2]
    if d % 32:
        raise ValueError(f"head dim {d}: tl.dot needs halves of at least 16 channels, a multiple of 16")
    args = [t.contiguous() for t in (query, u, sv, outlier_k, outlier_v, tail_k, tail_v)]
    q, u, sv, outlier_k, outlier_v, tail_k, tail_v = args
    host_rows, ctx = 0, 0
    if value_stores is not None:
        host, device = (None if t is not None and t.shape[0] == 0 else t for t in value_stores)
        if any(t is not None and not t.is_contiguous() for t in (host, device)):
            raise ValueError("shadowkv_fused_decode reads the value stores in place: they must be contiguous")
        host_rows = 0 if host is None else host.shape[0]
        ctx = host.shape[2] * chunk_size if host is not None else device.shape[2]
        values_sel = device if device is not None else host
        host_ptr = host if host is not None else values_sel
    else:
        values_sel = host_ptr = values_sel.contiguous()
    ids = chunk_ids.contiguous().to(torch.int32)
    if tail_len is None:
        tail_len = torch.full((1,), tail_k.shape[2], dtype=torch.int32, device=q.device)
    inv_freq = rotary.inv_freq.to(device=q.device, dtype=torch.float32).contiguous()
    pos0 = pos0.reshape(-1).contiguous()
    if out is None:
        out = torch.empty(b, hq, d, dtype=query.dtype, device=q.device)
    ieee = q.dtype == torch.float32
    group = hq // h
    # (tokens per block, rank per block, warps): on sm_90 (bf16, read off the cubin of Triton 3.9) the largest token
    # block that keeps the loop off the stack: head dim 64, 64 tokens (127 registers); 128, 32 tokens (126; 64
    # tokens take 212 and a stack); reading the value stores takes more (211 with a 32-byte stack, 192). Small on
    # the interpreter, where every lane is Python.
    if interpreting():
        block_n, block_r, warps = 32, 32, 4
    else:
        block_n, block_r, warps = (64 if d <= 64 else 32), 32, 8
    per, splits = token_splits(k * chunk_size, b * h, block_n, splits)
    if splits > 1:
        m = torch.empty(b * hq, splits, dtype=torch.float32, device=q.device)
        l_ = torch.empty_like(m)
        acc = torch.empty(b * hq, splits, d, dtype=torch.float32, device=q.device)
    else:
        m = l_ = acc = out  # not read: the one slice writes the output itself
    _shadowkv_fused_decode_kernel[(b * h, splits)](
        q, u, sv, ids, values_sel, host_ptr, outlier_k, outlier_v, tail_k, tail_v, tail_len, pos0, inv_freq, out,
        m, l_, acc, h, group, k, outlier_k.shape[2], n, r, tail_k.shape[2], host_rows, ctx,
        1 if pos0.numel() > 1 else 0, float(getattr(rotary, "attention_scaling", 1.0)), scaling * 1.4426950408889634,
        per, splits,
        CS=chunk_size, D=d, HALF=d // 2, BLOCK_N=block_n, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_R=block_r, IEEE=ieee, FROM_STORE=value_stores is not None, SPLIT=splits > 1, num_warps=warps,
    )
    if splits > 1:
        combine_partials(m, l_, acc, out.view(b * hq, d))
    COUNTERS["shadowkv_fused_decode"] += 1
    return out


PROGRAMS_PER_SM = 4
"""Programs the slices aim for on each SM: two resident at a time (126-211 registers x 256 threads of the
64K-register file), two waves; one program a (row, head) left 132 SMs with 168 programs at batch 21."""


def token_splits(tokens: int, programs: int, block_n: int, splits: int | None = None) -> tuple[int, int]:
    """``(tokens per slice, slices)`` of the selected tokens: enough slices for :data:`PROGRAMS_PER_SM` programs
    an SM over the ``programs`` (row, head) pairs, each slice at least four token blocks (fewer slices would leave
    SMs idle, shorter ones spend more on partials and the combine than they save); ``splits`` forces a count
    (the CPU tests exercise the partials and the combine with 2)."""
    if splits is None:
        if interpreting() or not torch.cuda.is_available():
            splits = 1
        else:
            sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
            splits = max(1, min(triton.cdiv(PROGRAMS_PER_SM * sms, programs), tokens // (4 * block_n)))
    per = triton.cdiv(triton.cdiv(max(tokens, 1), splits), block_n) * block_n
    return per, max(1, triton.cdiv(tokens, per)) if tokens else 1
