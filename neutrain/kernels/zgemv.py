"""``zgemv``: ``y = x @ W.T`` for one row of ``x`` (or up to 8, for speculative verification) with ``W`` in
the zgemv layout (:mod:`neutrain.compress.zgemv`), decoded in registers and never written out.

At batch 1 a decode step reads every weight once, so its time is bytes over bandwidth; the layout is 12
bits a weight against bf16's 16. Each program owns ``BLOCK_N`` rows and walks a slice of the row's groups
(8 weights, three 32-bit words: the codes and two words of low bytes), ``BLOCK_K / 8`` groups at a time:

* a pair of weights becomes two fp32 (the bf16 patterns in their high halves) with a rotate, a mask and two
  byte permutes (the layout puts the bits where they go: 3.9 instructions a weight for sm_90, FMA included,
  against 3.2 for the dense bf16 GEMV's loop); no base is added: ``w'`` carries exponent ``2c + e0`` and
  the row's base returns as one power-of-two scale of the row's sum, with ``x`` pre-scaled by
  ``2**X_SHIFT`` so the products are the same real numbers as ``x * w`` (exact in fp32);
* each times its ``x`` column, accumulated in fp32 in a ``BLOCK_N x BLOCK_K / 8`` tile, reduced once at the
  end;
* the escapes of the program's rows (a CSR list, 3 to 5 in 10,000 trained weights) are added as
  ``x[col] * value``, in a fixed order, in chunks dealt to the K slices; a slice reads its first chunk before
  its stream and adds it after;
* ``split > 1`` writes fp32 partial sums ``[split, M, N]``; the last slice of a row block to finish (a counter
  per row block, reset by that slice) adds them in slice order, so one launch does it all and the sum is the
  same on every call (a greedy decode repeats itself). ``serial=False`` leaves the sum to a second kernel, as
  :mod:`neutrain.kernels.gemv` does.

With ``M > 1`` rows of ``x`` each decoded pair is used ``M`` times (one accumulator per row of x, in the
registers that hold the pair), so verifying a few drafted tokens reads the weight once too; more rows a
thread (``block_n`` 32 or 64) then share each load and scaling of x. The pure-PyTorch reference is
:func:`neutrain.compress.zgemv.zgemv_reference`; which configuration is fastest per shape is measured by
``benchmarks/decode/zgemv.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from neutrain.kernels import interpreting
from neutrain.kernels.gemv import _sum_partials_kernel

X_SHIFT = 80  # the layout's (neutrain.compress.zgemv.X_SHIFT); kernels may not import compress
MAX_ROWS = 8
_X_SCALE = tl.constexpr(2.0**X_SHIFT)
_X_SHIFT = tl.constexpr(X_SHIFT)


@triton.jit
def _prmt(a, b, SEL: tl.constexpr, PTX: tl.constexpr, ASM: tl.constexpr):
    """PTX ``prmt.b32`` (``PTX`` spells it with selector ``SEL``): byte ``i`` of the result is byte
    ``(SEL >> 4 i) & 7`` of ``{b, a}`` (0-3: ``a``'s, 4-7: ``b``'s); one instruction on the GPU, the same bits
    in shifts and masks under the interpreter (which runs no PTX)."""
    if ASM:
        out = tl.inline_asm_elementwise(PTX, "=r,r,r", [a, b], dtype=tl.uint32, is_pure=True, pack=1)
    else:
        out = tl.zeros_like(a)
        for i in tl.static_range(4):
            if ((SEL >> (4 * i)) & 7) < 4:
                out |= ((a >> (8 * ((SEL >> (4 * i)) & 3))) & 0xFF) << (8 * i)
            else:
                out |= ((b >> (8 * ((SEL >> (4 * i)) & 3))) & 0xFF) << (8 * i)
    return out


@triton.jit
def _pair(code, raw_lo, raw_hi, P: tl.constexpr, PRMT: tl.constexpr, ASM: tl.constexpr):
    """Pair ``P`` of a group as two fp32 (``w'``, see the layout): low lane, high lane."""
    if P == 0:
        rot = code
    else:
        rot = (code << (4 * P)) | (code >> (32 - 4 * P))
    raw = raw_lo if P < 2 else raw_hi
    if PRMT:  # each lane's two bytes straight into place: [code byte, low byte, 0, 0]
        signs_codes = rot & 0x87008700  # bytes 0 and 2 are zero: the zeros the permutes take
        if P % 2 == 0:  # the low bytes are bytes 0 and 2 of the raw word
            lo = _prmt(raw, signs_codes, 0x5044, "prmt.b32 $0, $1, $2, 0x5044;", ASM)
            hi = _prmt(raw, signs_codes, 0x7244, "prmt.b32 $0, $1, $2, 0x7244;", ASM)
        else:  # bytes 1 and 3
            lo = _prmt(raw, signs_codes, 0x5144, "prmt.b32 $0, $1, $2, 0x5144;", ASM)
            hi = _prmt(raw, signs_codes, 0x7344, "prmt.b32 $0, $1, $2, 0x7344;", ASM)
        return lo.to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True)
    if P % 2 == 1:
        raw = raw >> 8
    bits = (rot & 0x87008700) | (raw & 0x00FF00FF)
    return (bits << 16).to(tl.float32, bitcast=True), (bits & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _x_pair(x_ptr, xw_ptr, m, K, G, gs, g_ok, P: tl.constexpr, X_WORDS: tl.constexpr, EVEN: tl.constexpr):
    """Row ``m`` of ``x`` at pair ``P``'s columns ``P * 2G + 2 gs`` and ``+ 1``, in fp32, times ``2**X_SHIFT``."""
    if X_WORDS:  # bf16 x, K even: one 32-bit word holds both columns
        word = P * G + gs
        if EVEN:  # K == 8 G: every word of the slice exists
            xw = tl.load(xw_ptr + m * (K // 2) + word)
        else:
            xw = tl.load(xw_ptr + m * (K // 2) + word, mask=g_ok & (word < K // 2), other=0)
        xw = xw.to(tl.uint32, bitcast=True)
        xa = (xw << 16).to(tl.float32, bitcast=True)
        xb = (xw & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        col = P * 2 * G + 2 * gs
        xa = tl.load(x_ptr + m * K + col, mask=g_ok & (col < K), other=0).to(tl.float32)
        xb = tl.load(x_ptr + m * K + col + 1, mask=g_ok & (col + 1 < K), other=0).to(tl.float32)
    return xa * _X_SCALE, xb * _X_SCALE


@triton.jit
def _accumulate(acc, lo, hi, x_ptr, xw_ptr, m: tl.constexpr, K, G, gs, g_ok, P: tl.constexpr,
                X_WORDS: tl.constexpr, EVEN: tl.constexpr):
    """``acc`` (row ``m`` of x's ``[BLOCK_N, BLOCK_G]`` sums) plus a decoded pair times its two x columns."""
    xa, xb = _x_pair(x_ptr, xw_ptr, m, K, G, gs, g_ok, P, X_WORDS, EVEN)
    acc += lo * xa[None, :]
    acc += hi * xb[None, :]
    return acc


@triton.jit
def _escape_sum(x_ptr, row, col, val, ok, rows):
    """``sum x[col] * value`` over a chunk of escapes, per row of the block ``[BLOCK_N]``."""
    val = ((val.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)  # the exact bf16, NaN payloads too
    xv = tl.load(x_ptr + col, mask=ok, other=0).to(tl.float32)
    return tl.sum(tl.where(row[:, None] == rows[None, :], (xv * val)[:, None], 0.0), axis=0)


@triton.jit
def _finish_row(acc, m: tl.constexpr, f1, f2, x_ptr, esc_row_ptr, esc_col_ptr, esc_val_ptr, e_row, e_col, e_val,
                e_ok, first, last, rows, row_ok, pid_k, split, K, N, out_ptr, part_ptr, M: tl.constexpr,
                ESC_BLOCK: tl.constexpr, PARTIAL: tl.constexpr):
    """Row ``m`` of x: the row sums scaled by the rows' bases, plus the escapes, stored (or its partial)."""
    y = tl.sum(acc, axis=1) * f1 * f2 + _escape_sum(x_ptr + m * K, e_row, e_col, e_val, e_ok, rows)
    for e in range(first + (pid_k + split) * ESC_BLOCK, last, split * ESC_BLOCK):  # more than a chunk: rare
        idx = e + tl.arange(0, ESC_BLOCK)
        ok = idx < last
        y += _escape_sum(x_ptr + m * K, tl.load(esc_row_ptr + idx, mask=ok, other=-1),
                         tl.load(esc_col_ptr + idx, mask=ok, other=0), tl.load(esc_val_ptr + idx, mask=ok, other=0),
                         ok, rows)
    if PARTIAL:
        tl.store(part_ptr + pid_k * M * N + m * N + rows, y, mask=row_ok)
    else:
        tl.store(out_ptr + m * N + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _zgemv_kernel(x_ptr, xw_ptr, codes_ptr, raw_lo_ptr, raw_hi_ptr, base_ptr, esc_ptr_ptr, esc_row_ptr, esc_col_ptr,
                  esc_val_ptr, out_ptr, part_ptr, count_ptr, N, K, G, g_per_split, split,
                  M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, ESC_BLOCK: tl.constexpr,
                  X_WORDS: tl.constexpr, EVEN: tl.constexpr, PARTIAL: tl.constexpr, SERIAL: tl.constexpr,
                  PRMT: tl.constexpr, ASM: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    # The escapes of the block's rows, in chunks of ESC_BLOCK dealt to the K slices in turn (slice s adds
    # chunks s, s + split, ...). A slice's first chunk is read before the stream and used after it, so its
    # latency hides behind the stream; further chunks (rare) are read at the end.
    first = tl.load(esc_ptr_ptr + pid_n * BLOCK_N)
    last = tl.load(esc_ptr_ptr + tl.minimum(pid_n * BLOCK_N + BLOCK_N, N))
    idx = first + pid_k * ESC_BLOCK + tl.arange(0, ESC_BLOCK)
    e_ok = idx < last
    e_row = tl.load(esc_row_ptr + idx, mask=e_ok, other=-1)
    e_col = tl.load(esc_col_ptr + idx, mask=e_ok, other=0)
    e_val = tl.load(esc_val_ptr + idx, mask=e_ok, other=0)
    # One [BLOCK_N, BLOCK_G] accumulator per row of x, each in the weight tile's own layout: a decoded pair
    # feeds every row of x from the registers that hold it (a 3-D tile would move it through shared memory).
    acc0 = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
    if M > 1:
        acc1 = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
    if M > 2:
        acc2 = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
    if M > 3:
        acc3 = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
    if M > 4:
        acc4 = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
    if M > 5:
        acc5 = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
    if M > 6:
        acc6 = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
    if M > 7:
        acc7 = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
    start = pid_k * g_per_split
    row_off = rows[:, None].to(tl.int64) * G
    for g in range(start, tl.minimum(start + g_per_split, G), BLOCK_G):  # the last slice may be shorter
        gs = g + tl.arange(0, BLOCK_G)
        g_ok = gs < G
        off = row_off + gs[None, :]
        if EVEN:  # no masks: no zeroing of the load targets, no predicates
            code = tl.load(codes_ptr + off).to(tl.uint32, bitcast=True)
            raw_lo = tl.load(raw_lo_ptr + off).to(tl.uint32, bitcast=True)
            raw_hi = tl.load(raw_hi_ptr + off).to(tl.uint32, bitcast=True)
        else:
            ok = row_ok[:, None] & g_ok[None, :]
            code = tl.load(codes_ptr + off, mask=ok, other=0).to(tl.uint32, bitcast=True)
            raw_lo = tl.load(raw_lo_ptr + off, mask=ok, other=0).to(tl.uint32, bitcast=True)
            raw_hi = tl.load(raw_hi_ptr + off, mask=ok, other=0).to(tl.uint32, bitcast=True)
        for p in tl.static_range(4):
            lo, hi = _pair(code, raw_lo, raw_hi, p, PRMT, ASM)
            acc0 = _accumulate(acc0, lo, hi, x_ptr, xw_ptr, 0, K, G, gs, g_ok, p, X_WORDS, EVEN)
            if M > 1:
                acc1 = _accumulate(acc1, lo, hi, x_ptr, xw_ptr, 1, K, G, gs, g_ok, p, X_WORDS, EVEN)
            if M > 2:
                acc2 = _accumulate(acc2, lo, hi, x_ptr, xw_ptr, 2, K, G, gs, g_ok, p, X_WORDS, EVEN)
            if M > 3:
                acc3 = _accumulate(acc3, lo, hi, x_ptr, xw_ptr, 3, K, G, gs, g_ok, p, X_WORDS, EVEN)
            if M > 4:
                acc4 = _accumulate(acc4, lo, hi, x_ptr, xw_ptr, 4, K, G, gs, g_ok, p, X_WORDS, EVEN)
            if M > 5:
                acc5 = _accumulate(acc5, lo, hi, x_ptr, xw_ptr, 5, K, G, gs, g_ok, p, X_WORDS, EVEN)
            if M > 6:
                acc6 = _accumulate(acc6, lo, hi, x_ptr, xw_ptr, 6, K, G, gs, g_ok, p, X_WORDS, EVEN)
            if M > 7:
                acc7 = _accumulate(acc7, lo, hi, x_ptr, xw_ptr, 7, K, G, gs, g_ok, p, X_WORDS, EVEN)
    # The row's base returns as 2**(2 hb - 2 - X_SHIFT), in two factors (each a normal fp32 for every base).
    shift = 2 * tl.load(base_ptr + rows, mask=row_ok, other=1).to(tl.int32) - 2 - _X_SHIFT
    half = shift >> 1
    f1 = ((half + 127) << 23).to(tl.float32, bitcast=True)
    f2 = ((shift - half + 127) << 23).to(tl.float32, bitcast=True)
    _finish_row(acc0, 0, f1, f2, x_ptr, esc_row_ptr, esc_col_ptr, esc_val_ptr, e_row, e_col, e_val, e_ok, first,
                last, rows, row_ok, pid_k, split, K, N, out_ptr, part_ptr, M, ESC_BLOCK, PARTIAL)
    if M > 1:
        _finish_row(acc1, 1, f1, f2, x_ptr, esc_row_ptr, esc_col_ptr, esc_val_ptr, e_row, e_col, e_val, e_ok, first,
                    last, rows, row_ok, pid_k, split, K, N, out_ptr, part_ptr, M, ESC_BLOCK, PARTIAL)
    if M > 2:
        _finish_row(acc2, 2, f1, f2, x_ptr, esc_row_ptr, esc_col_ptr, esc_val_ptr, e_row, e_col, e_val, e_ok, first,
                    last, rows, row_ok, pid_k, split, K, N, out_ptr, part_ptr, M, ESC_BLOCK, PARTIAL)
    if M > 3:
        _finish_row(acc3, 3, f1, f2, x_ptr, esc_row_ptr, esc_col_ptr, esc_val_ptr, e_row, e_col, e_val, e_ok, first,
                    last, rows, row_ok, pid_k, split, K, N, out_ptr, part_ptr, M, ESC_BLOCK, PARTIAL)
    if M > 4:
        _finish_row(acc4, 4, f1, f2, x_ptr, esc_row_ptr, esc_col_ptr, esc_val_ptr, e_row, e_col, e_val, e_ok, first,
                    last, rows, row_ok, pid_k, split, K, N, out_ptr, part_ptr, M, ESC_BLOCK, PARTIAL)
    if M > 5:
        _finish_row(acc5, 5, f1, f2, x_ptr, esc_row_ptr, esc_col_ptr, esc_val_ptr, e_row, e_col, e_val, e_ok, first,
                    last, rows, row_ok, pid_k, split, K, N, out_ptr, part_ptr, M, ESC_BLOCK, PARTIAL)
    if M > 6:
        _finish_row(acc6, 6, f1, f2, x_ptr, esc_row_ptr, esc_col_ptr, esc_val_ptr, e_row, e_col, e_val, e_ok, first,
                    last, rows, row_ok, pid_k, split, K, N, out_ptr, part_ptr, M, ESC_BLOCK, PARTIAL)
    if M > 7:
        _finish_row(acc7, 7, f1, f2, x_ptr, esc_row_ptr, esc_col_ptr, esc_val_ptr, e_row, e_col, e_val, e_ok, first,
                    last, rows, row_ok, pid_k, split, K, N, out_ptr, part_ptr, M, ESC_BLOCK, PARTIAL)
    if PARTIAL and SERIAL:  # the last slice of this row block to finish adds the partials, in slice order
        tl.debug_barrier()  # every thread's partials are written before the count goes up
        done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == split - 1:
            tl.debug_barrier()
            for m in tl.static_range(M):
                total = tl.load(part_ptr + m * N + rows, mask=row_ok, other=0.0, cache_modifier=".cg")
                for s in range(1, split):
                    total += tl.load(part_ptr + (s * M + m) * N + rows, mask=row_ok, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + m * N + rows, total.to(out_ptr.dtype.element_ty), mask=row_ok)
            tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next call (and a CUDA graph's replay)


def _check(x: torch.Tensor, zw, block_n: int, block_k: int, split: int) -> tuple[int, int, int]:
    n, k = zw.shape
    if x.shape[-1] != k:
        raise ValueError(f"zgemv: x has {x.shape[-1]} columns, the weight {tuple(zw.shape)} needs {k}")
    m = x.numel() // k if k else 0
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"zgemv takes 1 to {MAX_ROWS} rows of x, got {m} (shape {tuple(x.shape)})")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"zgemv: x must be bf16, fp16 or fp32, got {x.dtype}")
    if x.device != zw.codes.device:
        raise ValueError(f"zgemv: x is on {x.device}, the weight on {zw.codes.device}")
    if split < 1 or block_n < 1 or block_k < 8 or block_n & (block_n - 1) or block_k & (block_k - 1):
        raise ValueError(f"zgemv: block_n and block_k must be powers of two (block_k >= 8) and split >= 1 "
                         f"(got {block_n}, {block_k}, {split})")
    return m, n, k


def zgemv(x: torch.Tensor, zw, *, block_n: int = 32, block_k: int = 256, split: int = 1, num_warps: int = 4,
          serial: bool = True, prmt: bool = True) -> torch.Tensor:
    """``x @ W.T`` for ``x`` of 1 to 8 rows (``[K]``, ``[M, K]``, ``[1, M, K]``, ...) and ``zw`` a
    :class:`~neutrain.compress.zgemv.ZgemvWeight` ``[N, K]`` on the same device; fp32 accumulation,
    output in ``x``'s dtype and leading shape. ``block_k`` weights of a row per step (a multiple of 8),
    ``split`` slices of K whose partial sums are added in slice order: by the last slice of each row block
    (``serial``, one launch; the weight's ``counters`` track the slices) or by a second kernel. ``prmt``
    places each lane's two bytes with one byte permute (PTX ``prmt``; emulated under the interpreter), else
    shifts and masks do (the same bits, more instructions). Products
    are exact while ``|x| < 2**48`` (larger gives inf).

    Example:
        >>> # zw = ZgemvWeight.from_bf16(layer.weight); y = zgemv(x, zw, split=4)  # == F.linear(x, layer.weight)
    """
    m, n, k = _check(x, zw, block_n, block_k, split)
    lead = x.shape[:-1]
    x = x.reshape(m, k).contiguous()
    g = zw.codes.shape[1]
    block_g = block_k // 8
    per_split = triton.cdiv(triton.cdiv(g, split), block_g) * block_g
    split = triton.cdiv(g, per_split)  # no empty slice
    words = x.dtype == torch.bfloat16 and k % 2 == 0 and x.data_ptr() % 4 == 0
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, block_n), split)
    even = n % block_n == 0 and g % block_g == 0 and k == 8 * g  # every tile whole: the unmasked loop
    _zgemv_kernel[grid](x, x.view(torch.int32) if words else x, zw.codes, zw.raw[0], zw.raw[1], zw.base, zw.esc_ptr,
                        zw.esc_row, zw.esc_col, zw.esc_val, out, part, zw.counters, n, k, g, per_split, split, M=m,
                        BLOCK_N=block_n, BLOCK_G=block_g, ESC_BLOCK=16,
                        X_WORDS=words, EVEN=even, PARTIAL=split > 1, SERIAL=serial, PRMT=prmt,
                        ASM=not interpreting(), num_warps=num_warps)
    if split > 1 and not serial:
        block = 1024 if m * n >= 1024 else triton.next_power_of_2(m * n)
        _sum_partials_kernel[(triton.cdiv(m * n, block),)](part, out, m * n, SPLIT=split, BLOCK=block)
    return out.view(*lead, n)
