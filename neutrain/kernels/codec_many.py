"""Grouped codec kernels: many lossless bf16 tensors in one launch.

A tensor of 4M elements has only 16K lanes (256 symbols each): 12 % of an H100's
threads, so a launch per small matrix leaves most of the GPU idle and pays a launch
and a tail each time. These kernels take a *table* of tensors (``int64[ROWS, T]``,
one column per tensor, built by :mod:`neutrain.compress.many`) and run one program
per tile of all of them: program ``pid`` finds its tensor by comparing ``pid``
with the tensors' first tiles, loads that tensor's pointers from the table, and runs
the same per-tile code as the single-tensor kernels in :mod:`neutrain.kernels.codec`
(so the bytes are identical). All tensors of a group share the tile geometry
(``S``, ``L``, ``E``, compile-time constants).

Rows of the table: tile starts (``T`` entries: each tensor's first tile, then the
total, then a large sentinel), numel, data (the decode output or the encode input),
encode table, stream, lane counts, tile table, tails, LUT, stream capacity, status.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from neutrain.kernels import interpreting
from neutrain.kernels.codec import _count_lossless, _decode_lossless, _pack_lossless
from neutrain.kernels.codec_common import COMPILED, COUNTERS, _block_steps, _num_warps
from neutrain.kernels.launch import Launcher

ROWS = 11
(ROW_STARTS, ROW_NUMEL, ROW_DATA, ROW_ENC, ROW_STREAM, ROW_LANE_WORDS, ROW_TILE_BASE, ROW_TAILS, ROW_LUT,
 ROW_CAPACITY, ROW_STATUS) = range(ROWS)
_NUMEL = tl.constexpr(ROW_NUMEL)
_DATA = tl.constexpr(ROW_DATA)
_ENC = tl.constexpr(ROW_ENC)
_STREAM = tl.constexpr(ROW_STREAM)
_LANE_WORDS = tl.constexpr(ROW_LANE_WORDS)
_TILE_BASE = tl.constexpr(ROW_TILE_BASE)
_TAILS = tl.constexpr(ROW_TAILS)
_LUT = tl.constexpr(ROW_LUT)
_CAPACITY = tl.constexpr(ROW_CAPACITY)
_STATUS = tl.constexpr(ROW_STATUS)


@triton.jit
def _locate(table_ptr, T: tl.constexpr):
    """(program id, tensor column, tile within the tensor, tensor's first tile, tensor's tiles)."""
    pid = tl.program_id(0).to(tl.int64)
    starts = tl.load(table_ptr + tl.arange(0, T))
    t = tl.sum((starts <= pid).to(tl.int32), axis=0) - 1
    first = tl.load(table_ptr + t)
    return pid, t, pid - first, first, tl.load(table_ptr + t + 1) - first


@triton.jit
def _field(table_ptr, row: tl.constexpr, t, T: tl.constexpr):
    return tl.load(table_ptr + row * T + t)


@triton.jit
def _pointer(table_ptr, row: tl.constexpr, t, T: tl.constexpr, dtype: tl.constexpr):
    return _field(table_ptr, row, t, T).to(tl.pointer_type(dtype))


@triton.jit
def _tile_span(table_ptr, T: tl.constexpr, S: tl.constexpr, L: tl.constexpr, E: tl.constexpr):
    """The encode kernels' shared prologue: :func:`_locate`, then the tile's first element
    within its tensor and how many of its elements remain (at most one tile's worth)."""
    pid, t, tile, first, tiles = _locate(table_ptr, T)
    base = tile * (S * L * E)
    remaining = tl.minimum(_field(table_ptr, _NUMEL, t, T) - base, S * L * E).to(tl.int32)
    return pid, t, tile, first, tiles, base, remaining


@triton.jit
def _decode_group_kernel(table_ptr, T: tl.constexpr, S: tl.constexpr, L: tl.constexpr, E: tl.constexpr,
                         EVEN: tl.constexpr, FUNNEL: tl.constexpr, PAIRS: tl.constexpr):
    pid, t, tile, first, tiles = _locate(table_ptr, T)
    out = _pointer(table_ptr, _DATA, t, T, tl.int16)
    _decode_lossless(_pointer(table_ptr, _STREAM, t, T, tl.int32), _pointer(table_ptr, _LANE_WORDS, t, T, tl.uint8),
                     _pointer(table_ptr, _TILE_BASE, t, T, tl.int64), _pointer(table_ptr, _TAILS, t, T, tl.uint8),
                     _pointer(table_ptr, _LUT, t, T, tl.int16), out + tile * (S * L * E), tile,
                     _field(table_ptr, _NUMEL, t, T), S, L, E, EVEN, FUNNEL, PAIRS)


@triton.jit
def _count_group_kernel(table_ptr, counts_ptr, scratch_ptr, G, T: tl.constexpr, S: tl.constexpr, L: tl.constexpr,
                        E: tl.constexpr, BS: tl.constexpr):
    pid, t, tile, first, tiles, base, remaining = _tile_span(table_ptr, T, S, L, E)
    _count_lossless(_pointer(table_ptr, _DATA, t, T, tl.int16) + base, _pointer(table_ptr, _ENC, t, T, tl.int32),
                    counts_ptr + pid * L, scratch_ptr + pid, scratch_ptr + G + pid, remaining, S, L, E, BS)


@triton.jit
def _pack_group_kernel(table_ptr, counts_ptr, cum_ptr, G, T: tl.constexpr, S: tl.constexpr, L: tl.constexpr,
                       E: tl.constexpr, EVEN: tl.constexpr):
    pid, t, tile, first, tiles, base, remaining = _tile_span(table_ptr, T, S, L, E)
    before = tl.maximum(first - 1, 0)
    base_w = tl.where(first > 0, tl.load(cum_ptr + before), 0)
    base_b = tl.where(first > 0, tl.load(cum_ptr + G + before), 0)
    _pack_lossless(_pointer(table_ptr, _DATA, t, T, tl.int16) + base, _pointer(table_ptr, _ENC, t, T, tl.int32),
                   counts_ptr + pid * L, cum_ptr + first, G, base_w, base_b, tile, tiles,
                   _field(table_ptr, _CAPACITY, t, T), _pointer(table_ptr, _STREAM, t, T, tl.int32),
                   _pointer(table_ptr, _TAILS, t, T, tl.uint8), _pointer(table_ptr, _LANE_WORDS, t, T, tl.uint8),
                   _pointer(table_ptr, _TILE_BASE, t, T, tl.int64), _pointer(table_ptr, _STATUS, t, T, tl.int64),
                   remaining, S, L, E, EVEN)


# Through the compiled launchers (kernels.launch): training runs these once per layer and pass, from Python.
_DECODE = Launcher(_decode_group_kernel)
_COUNT = Launcher(_count_group_kernel)
_PACK = Launcher(_pack_group_kernel)


def decode_group(table: torch.Tensor, tiles: int, steps: int, lanes: int, elems: int, even: bool,
                 num_warps=None, aligned: bool = False) -> None:
    """Decode every tile of the table's tensors into their outputs (one launch); ``aligned``: every
    output starts on 8 bytes (then, with ``even`` and 4 elements, a lane stores a step as one word)."""
    if tiles:
        COMPILED["decode_group"] = _DECODE((tiles,), (table,), {
            "T": table.shape[1], "S": steps, "L": lanes, "E": elems, "EVEN": even, "FUNNEL": not interpreting(),
            "PAIRS": aligned and even and elems == 4}, num_warps=_num_warps(lanes, num_warps))
    COUNTERS["decode"] += 1


def count_group(table: torch.Tensor, counts: torch.Tensor, scratch: torch.Tensor, steps: int, lanes: int,
                elems: int, num_warps=None) -> None:
    """Pass 1 of every tensor of the table: lane counts and tile words / bits over all their tiles."""
    tiles = scratch.shape[1]
    if tiles:
        COMPILED["count_group"] = _COUNT((tiles,), (table, counts, scratch, tiles), {
            "T": table.shape[1], "S": steps, "L": lanes, "E": elems, "BS": _block_steps(steps, lanes * elems)},
            num_warps=_num_warps(lanes, num_warps))
    COUNTERS["count"] += 1


def pack_group(table: torch.Tensor, counts: torch.Tensor, cum: torch.Tensor, steps: int, lanes: int, elems: int,
               even: bool, num_warps=None) -> None:
    """Pass 2 of every tensor of the table; each commits only if its stream fits (see ``_pack_lossless``)."""
    tiles = cum.shape[1]
    if tiles:
        COMPILED["pack_group"] = _PACK((tiles,), (table, counts, cum, tiles), {
            "T": table.shape[1], "S": steps, "L": lanes, "E": elems, "EVEN": even},
            num_warps=_num_warps(lanes, num_warps))
    COUNTERS["pack"] += 1
