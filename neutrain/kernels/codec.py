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
* :func:`pack` (pass 2): each lane packs its codes MSB-first through a 64-bit
  accumulator, storing a 32-bit word whenever 32 bits are ready.
* :func:`decode`: each lane keeps a 64-bit bit buffer holding at least 32 valid
  bits before every symbol (a symbol takes at most 21), peeks 12 bits into the
  8 KiB decode LUT (L1-resident), reads a 9-bit literal after an escape, and
  refills one word whenever fewer than 32 bits remain.

Rounding for lossy modes is integer arithmetic, identical to
:func:`neutrain.compress.layout.split`: never float casts, which Triton's CPU
interpreter truncates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

COUNTERS = {"count": 0, "pack": 0, "decode": 0}
"""Kernel launches, so tests can assert that the fast path ran."""


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
                  S: tl.constexpr, L: tl.constexpr, K: tl.constexpr):
    P: tl.constexpr = 8 // (K + 1)
    R: tl.constexpr = L // P
    tile = tl.program_id(0).to(tl.int64)
    row = tl.arange(0, R)
    col = tl.arange(0, P)
    lane = row[:, None] * P + col[None, :]
    base = tile * (S * L)
    lane_bits = tl.zeros([R, P], dtype=tl.int32)
    for s in range(S):
        step = base + s * L
        idx = step + lane
        valid = idx < N
        x = tl.load(x_ptr + idx, mask=valid, other=0).to(tl.int32) & 0xFFFF
        sym, tail = _split_bf16(x, K)
        entry = tl.load(enc_ptr + sym, mask=valid, other=0)
        lane_bits += entry >> 24
        packed = tl.sum(tail << (col[None, :] * (K + 1)), axis=1)
        tl.store(tails_ptr + step // P + row, packed.to(tl.uint8), mask=(step + row * P) < N)
    words = (lane_bits + 31) // 32
    tl.store(lane_words_ptr + tile * L + lane, words.to(tl.uint8))
    tl.store(tile_words_ptr + tile, tl.sum(tl.sum(words, axis=1), axis=0).to(tl.int64))
    tl.store(tile_bits_ptr + tile, tl.sum(tl.sum(lane_bits, axis=1), axis=0).to(tl.int64))


@triton.jit
def _pack_kernel(x_ptr, enc_ptr, lane_words_ptr, tile_base_ptr, stream_ptr, N,
                 S: tl.constexpr, L: tl.constexpr, K: tl.constexpr):
    tile = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, L)
    count = tl.load(lane_words_ptr + tile * L + lane).to(tl.int64)
    ptr = tl.load(tile_base_ptr + tile) + tl.cumsum(count, axis=0) - count
    acc = tl.zeros([L], dtype=tl.uint64)
    filled = tl.zeros([L], dtype=tl.int32)
    base = tile * (S * L)
    for s in range(S):
        idx = base + s * L + lane
        valid = idx < N
        x = tl.load(x_ptr + idx, mask=valid, other=0).to(tl.int32) & 0xFFFF
        sym, _ = _split_bf16(x, K)
        entry = tl.load(enc_ptr + sym, mask=valid, other=0)
        length = entry >> 24
        code = (entry & 0xFFFFFF).to(tl.uint64)
        acc = acc | (code << tl.where(length > 0, 64 - filled - length, 0).to(tl.uint64))
        filled += length
        full = filled >= 32
        word = (acc >> 32).to(tl.uint32).to(tl.int32, bitcast=True)
        tl.store(stream_ptr + ptr, word, mask=full)
        acc = tl.where(full, acc << 32, acc)
        filled = tl.where(full, filled - 32, filled)
        ptr += full.to(tl.int64)
    word = (acc >> 32).to(tl.uint32).to(tl.int32, bitcast=True)
    tl.store(stream_ptr + ptr, word, mask=filled > 0)


@triton.jit
def _decode_kernel(stream_ptr, lane_words_ptr, tile_base_ptr, tails_ptr, lut_ptr, tile_ids_ptr, out_ptr, N,
                   S: tl.constexpr, L: tl.constexpr, K: tl.constexpr, HAS_IDS: tl.constexpr):
    P: tl.constexpr = 8 // (K + 1)
    R: tl.constexpr = L // P
    pid = tl.program_id(0).to(tl.int64)
    if HAS_IDS:
        tile = tl.load(tile_ids_ptr + pid).to(tl.int64)
        out_base = pid * (S * L)
    else:
        tile = pid
        out_base = pid * (S * L)
    row = tl.arange(0, R)
    col = tl.arange(0, P)
    lane = row[:, None] * P + col[None, :]
    # Lane start = tile base + exclusive prefix sum of word counts in lane order.
    count = tl.load(lane_words_ptr + tile * L + lane).to(tl.int32)
    row_total = tl.sum(count, axis=1)
    before = (tl.cumsum(row_total, axis=0) - row_total)[:, None] + tl.cumsum(count, axis=1) - count
    ptr = tl.load(tile_base_ptr + tile) + before.to(tl.int64)
    hi = tl.load(stream_ptr + ptr).to(tl.uint32, bitcast=True).to(tl.uint64)
    lo = tl.load(stream_ptr + ptr + 1).to(tl.uint32, bitcast=True).to(tl.uint64)
    buf = (hi << 32) | lo
    nbits = tl.full([R, P], 64, dtype=tl.int32)
    ptr += 2
    base = tile * (S * L)
    for s in range(S):
        step = base + s * L
        valid = (step + lane) < N
        entry = tl.load(lut_ptr + (buf >> 52).to(tl.int32)).to(tl.int32)
        sym = entry & 0x1FF
        length = entry >> 9
        escaped = sym == 257
        literal = ((buf << length.to(tl.uint64)) >> 55).to(tl.int32)
        sym = tl.where(escaped, literal, sym)
        length = tl.where(escaped, length + 9, length)
        buf = buf << length.to(tl.uint64)
        nbits -= length
        need = (nbits < 32) & valid
        word = tl.load(stream_ptr + ptr, mask=need, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
        buf = buf | (word << tl.where(need, 32 - nbits, 0).to(tl.uint64))
        nbits = tl.where(need, nbits + 32, nbits)
        ptr += need.to(tl.int64)
        tail_byte = tl.load(tails_ptr + step // P + row, mask=(step + row * P) < N, other=0).to(tl.int32)
        tail = (tail_byte[:, None] >> (col[None, :] * (K + 1))) & ((1 << (K + 1)) - 1)
        bits = _merge_bf16(sym, tail, K)
        tl.store(out_ptr + out_base + s * L + lane, bits.to(tl.int16), mask=valid)


def _num_warps(lanes: int, num_warps: int | None) -> int:
    # One lane per thread up to 8 warps: enough independent lanes in flight per SM
    # (codec.md section 6 measured 8 warps best for 256-512 lanes).
    return num_warps or max(1, min(8, lanes // 32))


def count(x: torch.Tensor, enc_table, tails, lane_words, tile_words, tile_bits, steps, lanes, kept, num_warps=None):
    """Pass 1 on a contiguous bf16 tensor ``x``; fills ``tails``, ``lane_words``, ``tile_words``, ``tile_bits``."""
    tiles = tile_words.numel()
    if tiles:
        _count_kernel[(tiles,)](x.view(torch.int16), enc_table, tails, lane_words, tile_words, tile_bits, x.numel(),
                                S=steps, L=lanes, K=kept, num_warps=_num_warps(lanes, num_warps))
    COUNTERS["count"] += 1


def pack(x: torch.Tensor, enc_table, lane_words, tile_base, stream, steps, lanes, kept, num_warps=None):
    """Pass 2: write the lanes' codes into ``stream`` (``int32``)."""
    tiles = tile_base.numel() - 1
    if tiles:
        _pack_kernel[(tiles,)](x.view(torch.int16), enc_table, lane_words, tile_base, stream, x.numel(),
                               S=steps, L=lanes, K=kept, num_warps=_num_warps(lanes, num_warps))
    COUNTERS["pack"] += 1


def decode(stream, lane_words, tile_base, tails, lut, out: torch.Tensor, numel, steps, lanes, kept,
           tile_ids: torch.Tensor | None = None, num_warps=None):
    """Decode all tiles (or ``tile_ids``, each into its own ``S * L`` slot of ``out``) into bf16 ``out``."""
    programs = tile_base.numel() - 1 if tile_ids is None else tile_ids.numel()
    if programs:
        ids = tile_base if tile_ids is None else tile_ids  # any pointer will do when unused
        _decode_kernel[(programs,)](stream, lane_words, tile_base, tails, lut, ids, out.view(torch.int16), numel,
                                    S=steps, L=lanes, K=kept, HAS_IDS=tile_ids is not None,
                                    num_warps=_num_warps(lanes, num_warps))
    COUNTERS["decode"] += 1
