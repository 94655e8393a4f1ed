"""Triton kernels of the NeuZip codec (bf16): encode in two passes, decode in one.

The format and its pure-PyTorch reference live in :mod:`neutrain.compress.codec`
and :mod:`neutrain.compress.layout`; these kernels produce and read the same
bytes (the tests compare them bit for bit). One program handles one tile of
``S * L`` elements; its ``L`` lanes run side by side and walk the ``S`` steps in
a loop, so every load and store of weights, tails and outputs is coalesced,
while each lane reads or writes its own bitstream.

Lanes are held as a ``[L // P, P]`` block, ``P = 8 // tail_bits`` being the tails
per byte: a row of ``P`` neighbouring lanes shares one tail byte, which the
encoder assembles with a row sum and the decoder splits with shifts.

* :func:`count` (pass 1): split each weight, write its tail, sum code lengths per
  lane; write lane word counts and per-tile word and bit totals.
* :func:`pack` (pass 2): each lane packs its codes MSB-first through a 32-bit
  accumulator, storing a word whenever 32 bits are ready.
* :func:`decode`: each lane keeps three 32-bit words (two being read, one
  loaded ahead), takes the next 32 bits with a funnel shift, peeks 12 of them
  into the 8 KiB decode LUT (L1-resident), reads a 9-bit literal after an escape,
  and moves one word along whenever a symbol crosses a word boundary. All
  per-step arithmetic is 32-bit: the loops are instruction-bound.

Rounding for lossy modes is integer arithmetic, identical to
:func:`neutrain.compress.layout.split`: never float casts, which Triton's CPU
interpreter truncates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from neutrain.kernels import interpreting

COUNTERS = {"count": 0, "pack": 0, "decode": 0}
"""Kernel launches, so tests can assert that the fast path ran."""
COMPILED: dict = {}
"""Last compiled kernel per op (registers, PTX/SASS), for benchmarks/codec.py's resource report."""


PREFETCH_STEPS = 8
"""How many steps ahead the sequential loops prefetch their coalesced inputs into L1."""


@triton.jit
def _prefetch_l1(pointers):
    """Ask for the cache lines at ``pointers`` in L1 without waiting (PTX ``prefetch``).

    Why: the per-lane loops are sequential, so a load issued in a step stalls that
    step; a prefetch a few steps ahead creates no register dependency.
    """
    tl.inline_asm_elementwise("prefetch.global.L1 [$1]; mov.u32 $0, 0;", "=r,l", [pointers],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _split_bf16(x, K: tl.constexpr):
    """bf16 bit pattern (int32, 0..65535) -> (symbol, tail); mirrors ``layout.split``."""
    sign = x >> 15
    mag = x & 0x7FFF
    if K == 7:
        sym = mag >> 7
        mant = mag & 0x7F
    else:
        DROP: tl.constexpr = 7 - K
        lsb = (mag >> DROP) & 1
        rounded = ((mag + ((1 << (DROP - 1)) - 1) + lsb) >> DROP) << DROP
        rounded = tl.minimum(rounded, 0x7F80 - (1 << DROP))
        rounded = tl.where(mag == 0x7F80, mag, rounded)
        is_nan = mag > 0x7F80
        sym = tl.where(is_nan, 256, rounded >> 7)
        mant = tl.where(is_nan, 0, (rounded & 0x7F) >> DROP)
    return sym, (sign << K) | mant


@triton.jit
def _merge_bf16(sym, tail, K: tl.constexpr):
    """(symbol, tail) -> bf16 bit pattern (int32); mirrors ``layout.merge``."""
    sign = (tail >> K) & 1
    mag = (sym << 7) | ((tail & ((1 << K) - 1)) << (7 - K))
    if K != 7:
        mag = tl.where(sym == 256, 0x7FC0, mag)
    return (sign << 15) | mag


@triton.jit
def _count_kernel(x_ptr, enc_ptr, tails_ptr, lane_words_ptr, tile_words_ptr, tile_bits_ptr, N,
                  S: tl.constexpr, L: tl.constexpr, K: tl.constexpr, BS: tl.constexpr):
    # Nothing here is sequential per lane (lengths are summed), so each iteration
    # handles a [BS steps, R, P] block: many independent loads in flight, like a copy.
    P: tl.constexpr = 8 // (K + 1)
    R: tl.constexpr = L // P
    tile = tl.program_id(0).to(tl.int64)
    steps2 = tl.arange(0, BS)[:, None]
    rows2 = tl.arange(0, R)[None, :]
    step = steps2[:, :, None]
    row = rows2[:, :, None]
    col = tl.arange(0, P)[None, None, :]
    # 64-bit scalar bases, 32-bit per-lane offsets: 64-bit vector arithmetic costs
    # two or more instructions per op.
    base = tile * (S * L)
    x_tile = x_ptr + base
    tails_tile = tails_ptr + base // P
    remaining = tl.minimum(N - base, S * L).to(tl.int32)
    lane_bits = tl.zeros([R, P], dtype=tl.int32)
    for s0 in range(0, S, BS):
        offset = (s0 + step) * L + row * P + col
        valid = offset < remaining
        x = tl.load(x_tile + offset, mask=valid, other=0).to(tl.int32) & 0xFFFF
        sym, tail = _split_bf16(x, K)
        entry = tl.load(enc_ptr + sym, mask=valid, other=0)
        lane_bits += tl.sum(entry >> 24, axis=0)
        packed = tl.sum(tail << (col * (K + 1)), axis=2)
        byte = (s0 + steps2) * R + rows2
        tl.store(tails_tile + byte, packed.to(tl.uint8), mask=byte * P < remaining)
    lane = tl.arange(0, R)[:, None] * P + tl.arange(0, P)[None, :]
    words = (lane_bits + 31) // 32
    tl.store(lane_words_ptr + tile * L + lane, words.to(tl.uint8))
    tl.store(tile_words_ptr + tile, tl.sum(tl.sum(words, axis=1), axis=0).to(tl.int64))
    tl.store(tile_bits_ptr + tile, tl.sum(tl.sum(lane_bits, axis=1), axis=0).to(tl.int64))


@triton.jit
def _pack_kernel(x_ptr, enc_ptr, lane_words_ptr, tile_base_ptr, stream_ptr, N,
                 S: tl.constexpr, L: tl.constexpr, K: tl.constexpr, PREFETCH: tl.constexpr, PF: tl.constexpr):
    tile = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, L)
    count = tl.load(lane_words_ptr + tile * L + lane).to(tl.int32)
    rel = tl.cumsum(count, axis=0) - count  # lane start, in words from the tile's first word
    stream_tile = stream_ptr + tl.load(tile_base_ptr + tile)
    base = tile * (S * L)
    x_tile = x_ptr + base
    remaining = tl.minimum(N - base, S * L).to(tl.int32)
    # 32-bit accumulator holding `filled` (< 32) bits, MSB-aligned: a code (<= 21
    # bits) either fits, or completes a word and leaves its low `over` bits behind.
    acc = tl.zeros([L], dtype=tl.uint32)
    filled = tl.zeros([L], dtype=tl.int32)
    for s in range(S):
        offset = s * L + lane
        valid = offset < remaining
        if PREFETCH:
            ahead = offset + PF * L
            _prefetch_l1(x_tile + tl.where(ahead < remaining, ahead, 0))
        x = tl.load(x_tile + offset, mask=valid, other=0).to(tl.int32) & 0xFFFF
        sym, _ = _split_bf16(x, K)
        entry = tl.load(enc_ptr + sym, mask=valid, other=0)
        code = (entry & 0xFFFFFF).to(tl.uint32)
        total = filled + (entry >> 24)
        over = total - 32
        emit = over >= 0
        head = tl.where(emit, code >> tl.maximum(over, 0).to(tl.uint32),
                        code << tl.minimum(32 - total, 31).to(tl.uint32))
        word = acc | head
        tl.store(stream_tile + rel, word.to(tl.int32, bitcast=True), mask=emit)
        rest = tl.where(over > 0, code << tl.minimum(32 - over, 31).to(tl.uint32), 0)
        acc = tl.where(emit, rest, word)
        filled = tl.where(emit, over, total)
        rel += emit.to(tl.int32)
    tl.store(stream_tile + rel, acc.to(tl.int32, bitcast=True), mask=filled > 0)


@triton.jit
def _decode_kernel(stream_ptr, lane_words_ptr, tile_base_ptr, tails_ptr, lut_ptr, tile_ids_ptr, out_ptr, N,
                   S: tl.constexpr, L: tl.constexpr, K: tl.constexpr, HAS_IDS: tl.constexpr,
                   PREFETCH: tl.constexpr, PF: tl.constexpr):
    P: tl.constexpr = 8 // (K + 1)
    R: tl.constexpr = L // P
    pid = tl.program_id(0).to(tl.int64)
    if HAS_IDS:
        tile = tl.load(tile_ids_ptr + pid).to(tl.int64)
    else:
        tile = pid
    row = tl.arange(0, R)
    col = tl.arange(0, P)
    lane = row[:, None] * P + col[None, :]
    # Lane start = tile base + exclusive prefix sum of word counts in lane order.
    count = tl.load(lane_words_ptr + tile * L + lane).to(tl.int32)
    row_total = tl.sum(count, axis=1)
    rel = (tl.cumsum(row_total, axis=0) - row_total)[:, None] + tl.cumsum(count, axis=1) - count
    first_word = tl.load(tile_base_ptr + tile)
    stream_tile = stream_ptr + first_word
    if PREFETCH:
        # The tile's whole stream (~22 KiB at S = L = 256) into L1, one 128-byte line
        # per thread: refills then hit L1 instead of waiting on DRAM mid-chain.
        tile_words = (tl.load(tile_base_ptr + tile + 1) - first_word).to(tl.int32)
        line = tl.arange(0, L) * 32
        for i in range(0, tl.cdiv(tile_words, 32 * L)):
            word = i * (32 * L) + line
            _prefetch_l1(stream_tile + tl.where(word < tile_words, word, 0))
    # Three words per lane: w0:w1 hold the bits being read (from bit `pos` of w0),
    # w2 is loaded one word ahead, so no load sits on the decode dependency chain.
    w0 = tl.load(stream_tile + rel).to(tl.uint32, bitcast=True)
    w1 = tl.load(stream_tile + rel + 1).to(tl.uint32, bitcast=True)
    w2 = tl.load(stream_tile + rel + 2).to(tl.uint32, bitcast=True)
    rel += 3
    pos = tl.zeros([R, P], dtype=tl.int32)
    base = tile * (S * L)
    out_tile = out_ptr + pid * (S * L)
    tails_tile = tails_ptr + base // P
    remaining = tl.minimum(N - base, S * L).to(tl.int32)
    for s in range(S):
        offset = s * L + lane
        valid = offset < remaining
        # The next 32 stream bits (funnel shift; the split shift stays defined at pos = 0).
        shift = pos.to(tl.uint32)
        window = (w0 << shift) | ((w1 >> 1) >> (31 - shift))
        entry = tl.load(lut_ptr + (window >> 20).to(tl.int32)).to(tl.int32)
        sym = entry & 0x1FF
        length = entry >> 9
        literal = ((window << length.to(tl.uint32)) >> 23).to(tl.int32)
        escaped = sym == 257
        sym = tl.where(escaped, literal, sym)
        pos += tl.where(escaped, length + 9, length)
        # A symbol takes at most 21 bits, so at most one word is crossed per step.
        crossed = pos >= 32
        pos = tl.where(crossed, pos - 32, pos)
        advance = crossed & valid  # lanes past the tensor's end stop reading
        ahead = tl.load(stream_tile + rel, mask=advance, other=0).to(tl.uint32, bitcast=True)
        w0 = tl.where(advance, w1, w0)
        w1 = tl.where(advance, w2, w1)
        w2 = tl.where(advance, ahead, w2)
        rel += advance.to(tl.int32)
        if PREFETCH:
            ahead = (s + PF) * R + row
            _prefetch_l1(tails_tile + tl.where(ahead * P < remaining, ahead, 0))
        tail_byte = tl.load(tails_tile + s * R + row, mask=(s * L + row * P) < remaining, other=0).to(tl.int32)
        tail = (tail_byte[:, None] >> (col[None, :] * (K + 1))) & ((1 << (K + 1)) - 1)
        bits = _merge_bf16(sym, tail, K)
        tl.store(out_tile + offset, bits.to(tl.int16), mask=valid)


PREFETCH_STATUS = {"broken": None}
"""Set to the error text if a prefetching kernel failed to compile; kernels then run without."""


def _prefetch(requested: bool | None) -> bool:
    # Off by default: on an H200 it sped up 16M-element decodes (285 vs 236 GB/s) but
    # slowed larger ones (521 vs 606 GB/s) by adding instructions to an
    # instruction-bound loop (benchmarks/notes_codec.md). Never in the interpreter,
    # which cannot run inline PTX; prefetching changes timing, never results.
    if requested is None or interpreting():
        return False
    return bool(requested) and PREFETCH_STATUS["broken"] is None


def _launch(op: str, kernel, grid, *args, **meta):
    """Launch, falling back to the plain kernel if the prefetching variant does not compile."""
    try:
        COMPILED[op] = kernel[grid](*args, **meta)
    except Exception as error:  # compile errors surface as several exception types across Triton versions
        if not meta.get("PREFETCH"):
            raise
        PREFETCH_STATUS["broken"] = f"{type(error).__name__}: {error}"[:500]
        COMPILED[op] = kernel[grid](*args, **{**meta, "PREFETCH": False})


def _num_warps(lanes: int, num_warps: int | None) -> int:
    # One lane per thread, up to 16 warps: measured best on an H200 for 256 and
    # 512 lanes (benchmarks/notes_codec.md).
    return num_warps or max(1, min(16, lanes // 32))


def _block_steps(steps: int, lanes: int) -> int:
    """Steps per count iteration: ~4096 elements, and a power of two dividing ``steps``."""
    block = 1
    while block * 2 * lanes <= 4096 and steps % (block * 2) == 0:
        block *= 2
    return block


def count(x: torch.Tensor, enc_table, tails, lane_words, tile_words, tile_bits, steps, lanes, kept, num_warps=None):
    """Pass 1 on a contiguous bf16 tensor ``x``; fills ``tails``, ``lane_words``, ``tile_words``, ``tile_bits``."""
    tiles = tile_words.numel()
    if tiles:
        block = _block_steps(steps, lanes)
        COMPILED["count"] = _count_kernel[(tiles,)](
            x.view(torch.int16), enc_table, tails, lane_words, tile_words, tile_bits, x.numel(),
            S=steps, L=lanes, K=kept, BS=block, num_warps=_num_warps(lanes, num_warps))
    COUNTERS["count"] += 1


def pack(x: torch.Tensor, enc_table, lane_words, tile_base, stream, steps, lanes, kept, num_warps=None,
         prefetch=None):
    """Pass 2: write the lanes' codes into ``stream`` (``int32``)."""
    tiles = tile_base.numel() - 1
    if tiles:
        _launch("pack", _pack_kernel, (tiles,), x.view(torch.int16), enc_table, lane_words, tile_base, stream,
                x.numel(), S=steps, L=lanes, K=kept, PREFETCH=_prefetch(prefetch), PF=PREFETCH_STEPS,
                num_warps=_num_warps(lanes, num_warps))
    COUNTERS["pack"] += 1


def decode(stream, lane_words, tile_base, tails, lut, out: torch.Tensor, numel, steps, lanes, kept,
           tile_ids: torch.Tensor | None = None, num_warps=None, prefetch=None):
    """Decode all tiles (or ``tile_ids``, each into its own ``S * L`` slot of ``out``) into bf16 ``out``."""
    programs = tile_base.numel() - 1 if tile_ids is None else tile_ids.numel()
    if programs:
        ids = tile_base if tile_ids is None else tile_ids  # any pointer will do when unused
        _launch("decode", _decode_kernel, (programs,), stream, lane_words, tile_base, tails, lut, ids,
                out.view(torch.int16), numel, S=steps, L=lanes, K=kept, HAS_IDS=tile_ids is not None,
                PREFETCH=_prefetch(prefetch), PF=PREFETCH_STEPS, num_warps=_num_warps(lanes, num_warps))
    COUNTERS["decode"] += 1
