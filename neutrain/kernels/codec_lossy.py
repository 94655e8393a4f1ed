"""Triton kernels of the NeuZip codec's lossy bf16 modes (``k`` of 7 mantissa bits kept).

One element per lane and step, lanes held as a ``[L // P, P]`` block, ``P = 8 //
tail_bits`` being the tails per byte: a row of ``P`` neighbouring lanes shares one tail
byte, which the encoder assembles with a row sum and the decoder splits with shifts.
Pass 1 writes the tails, so this encoder always reads the stream length back between
its passes (:func:`neutrain.compress.stream.encode_lossy`). Rounding is integer
arithmetic, identical to :func:`neutrain.compress.layout.split`: never float casts,
which Triton's CPU interpreter truncates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from neutrain.kernels import interpreting
from neutrain.kernels.codec_common import (COMPILED, COUNTERS, PREFETCH_STEPS, _block_steps, _launch, _next_symbol,
                                           _num_warps, _prefetch, _prefetch_l1, _put_code)


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
    """Lossy pass 2 (one element per lane and step): each lane packs its codes at its start word."""
    tile = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, L)
    count = tl.load(lane_words_ptr + tile * L + lane).to(tl.int32)
    rel = tl.cumsum(count, axis=0) - count  # lane start, in words from the tile's first word
    stream_tile = stream_ptr + tl.load(tile_base_ptr + tile)
    x_tile = x_ptr + tile * (S * L)
    remaining = tl.minimum(N - tile * (S * L), S * L).to(tl.int32)
    acc = tl.zeros([L], dtype=tl.uint32)
    filled = tl.zeros([L], dtype=tl.int32)
    for s in range(S):
        offset = s * L + lane
        if PREFETCH:
            _prefetch_l1(x_tile + tl.where(offset + PF * L < remaining, offset + PF * L, 0))
        x = tl.load(x_tile + offset, mask=offset < remaining, other=0).to(tl.int32) & 0xFFFF
        sym, _ = _split_bf16(x, K)
        entry = tl.load(enc_ptr + sym, mask=offset < remaining, other=0)
        acc, filled, rel = _put_code(acc, filled, rel, entry, stream_tile)
    tl.store(stream_tile + rel, acc.to(tl.int32, bitcast=True), mask=filled > 0)


@triton.jit
def _decode_packed_kernel(stream_ptr, lane_words_ptr, tile_base_ptr, tails_ptr, lut_ptr, tile_ids_ptr, out_ptr, N,
                          S: tl.constexpr, L: tl.constexpr, K: tl.constexpr, HAS_IDS: tl.constexpr,
                          FUNNEL: tl.constexpr, PREFETCH: tl.constexpr, PF: tl.constexpr):
    """Lossy bf16 decode (one element per lane and step, P = 8 // (K+1) lanes per tail byte)."""
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
    # Each lane's first three words (on the 2D [R, P] lane block); _next_symbol loads the next ones.
    stream_tile = stream_ptr + tl.load(tile_base_ptr + tile)
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
        sym, w0, w1, w2, pos, rel = _next_symbol(w0, w1, w2, pos, rel, valid, lut_ptr, stream_tile, FUNNEL)
        if PREFETCH:
            ahead = (s + PF) * R + row
            _prefetch_l1(tails_tile + tl.where(ahead * P < remaining, ahead, 0))
        tail_byte = tl.load(tails_tile + s * R + row, mask=(s * L + row * P) < remaining, other=0).to(tl.int32)
        tail = (tail_byte[:, None] >> (col[None, :] * (K + 1))) & ((1 << (K + 1)) - 1)
        tl.store(out_tile + offset, _merge_bf16(sym, tail, K).to(tl.int16), mask=valid)


def count(x: torch.Tensor, enc_table, tails, lane_words, tile_words, tile_bits, steps, lanes, kept, num_warps=None):
    """Lossy pass 1 on a contiguous bf16 tensor ``x``; fills ``tails``, ``lane_words``, ``tile_words``, ``tile_bits``."""
    tiles = tile_words.numel()
    if tiles:
        block = _block_steps(steps, lanes)
        COMPILED["count"] = _count_kernel[(tiles,)](x.view(torch.int16), enc_table, tails, lane_words, tile_words,
                                                     tile_bits, x.numel(), S=steps, L=lanes, K=kept, BS=block,
                                                     num_warps=_num_warps(lanes, num_warps))
    COUNTERS["count"] += 1


def pack(x: torch.Tensor, enc_table, lane_words, tile_base, stream, steps, lanes, kept, num_warps=None,
         prefetch=None):
    """Lossy pass 2: write the lanes' codes into ``stream`` (``int32``)."""
    tiles = tile_base.numel() - 1
    if tiles:
        _launch("pack", _pack_kernel, (tiles,), x.view(torch.int16), enc_table, lane_words, tile_base, stream,
                x.numel(), S=steps, L=lanes, K=kept, PREFETCH=_prefetch(prefetch), PF=PREFETCH_STEPS,
                num_warps=_num_warps(lanes, num_warps))
    COUNTERS["pack"] += 1


def decode(stream, lane_words, tile_base, tails, lut, out: torch.Tensor, numel, steps, lanes, kept, ids, has_ids,
           num_warps=None, prefetch=None):
    """Decode the tiles (or ``ids``) of a lossy tensor into bf16 ``out``."""
    programs = ids.numel() if has_ids else tile_base.numel() - 1
    _launch("decode_lossy", _decode_packed_kernel, (programs,), stream, lane_words, tile_base, tails, lut, ids,
            out.view(torch.int16), numel, S=steps, L=lanes, K=kept, HAS_IDS=has_ids, FUNNEL=not interpreting(),
            PREFETCH=_prefetch(prefetch), PF=PREFETCH_STEPS, num_warps=_num_warps(lanes, num_warps))
