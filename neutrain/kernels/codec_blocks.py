"""Lossless bf16 encode of a tensor's tiles ``[first, stop)`` only: the block re-encode's kernels.

A vocabulary matrix updated row block by row block (:mod:`neutrain.compress.blocks`)
is re-encoded block by block, in order, into a second stream. These launches run the
per-tile code of :mod:`neutrain.kernels.codec` unchanged on one block's tiles, with
*global* tile indices: lane counts, word/bit totals, tails and ``tile_base`` entries
land where the whole-tensor encode puts them, and ``cum`` holds the prefix sums of
all tiles so far, so each tile's stream offset is its offset in the whole new stream.
Encoding every block this way writes the bytes a whole-tensor encode writes (tested).

The data pointer is the block's own buffer (its first element is the block's first
tile's), so the dense tensor never exists whole.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from neutrain.kernels.codec import _count_lossless, _pack_lossless
from neutrain.kernels.codec_common import COUNTERS, _block_steps, _num_warps


@triton.jit
def _count_block_kernel(x_ptr, enc_ptr, counts_ptr, scratch_ptr, G, first, N,
                        S: tl.constexpr, L: tl.constexpr, E: tl.constexpr, BS: tl.constexpr):
    """Pass 1 of tiles ``first + pid``: ``x_ptr`` is the block's data (``N`` elements)."""
    pid = tl.program_id(0).to(tl.int64)
    tile = first + pid
    base = pid * (S * L * E)
    _count_lossless(x_ptr + base, enc_ptr, counts_ptr + tile * L, scratch_ptr + tile, scratch_ptr + G + tile,
                    tl.minimum(N - base, S * L * E).to(tl.int32), S, L, E, BS)


@triton.jit
def _pack_block_kernel(x_ptr, enc_ptr, counts_ptr, cum_ptr, G, first, stop, capacity, stream_ptr, tails_ptr,
                       lane_words_ptr, tile_base_ptr, status_ptr, N, S: tl.constexpr, L: tl.constexpr,
                       E: tl.constexpr, EVEN: tl.constexpr):
    """Pass 2 of tiles ``first + pid``; each commits only if the stream up to tile ``stop - 1`` fits."""
    pid = tl.program_id(0).to(tl.int64)
    tile = first + pid
    base = pid * (S * L * E)
    _pack_lossless(x_ptr + base, enc_ptr, counts_ptr + tile * L, cum_ptr, G, 0, 0, tile, stop, capacity, stream_ptr,
                   tails_ptr, lane_words_ptr, tile_base_ptr, status_ptr, tl.minimum(N - base, S * L * E).to(tl.int32),
                   S, L, E, EVEN)


def count_block(x: torch.Tensor, first: int, enc_table, counts, scratch, steps, lanes, elems, num_warps=None):
    """Pass 1 of the block ``x`` (contiguous bf16, starting at tile ``first``) into the whole-tensor
    ``counts`` (``uint8[tiles * lanes]``) and ``scratch`` (``int64[2, tiles]``) at its tiles."""
    tile_len = steps * lanes * elems
    programs = -(-x.numel() // tile_len)
    if programs:
        _count_block_kernel[(programs,)](
            x.view(torch.int16), enc_table, counts, scratch, scratch.shape[1], first, x.numel(), S=steps, L=lanes,
            E=elems, BS=_block_steps(steps, lanes * elems), num_warps=_num_warps(lanes, num_warps))
    COUNTERS["count"] += 1


def pack_block(x: torch.Tensor, first: int, enc_table, counts, cum, capacity: int, stream, tails, lane_words,
               tile_base, status, steps, lanes, elems, num_warps=None):
    """Pass 2 of the block ``x`` from ``cum`` (inclusive prefix sums over all tiles up to the block's
    last): its tails, lane counts and ``tile_base`` entries at its tiles, its codes at their offsets in
    ``stream``; nothing if the stream so far exceeds ``capacity`` words (``status`` is written only by
    a block holding tile 0: the caller sets the final status)."""
    tile_len = steps * lanes * elems
    programs = -(-x.numel() // tile_len)
    if programs:
        _pack_block_kernel[(programs,)](
            x.view(torch.int16), enc_table, counts, cum, cum.shape[1], first, first + programs, capacity, stream,
            tails, lane_words, tile_base, status, x.numel(), S=steps, L=lanes, E=elems,
            EVEN=x.numel() % elems == 0, num_warps=_num_warps(lanes, num_warps))
    COUNTERS["pack"] += 1
