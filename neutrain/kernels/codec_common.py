"""What every NeuZip codec kernel shares: launch bookkeeping, the bit reader and the code writer.

:mod:`neutrain.kernels.codec` (lossless), :mod:`neutrain.kernels.codec_lossy` and
:mod:`neutrain.kernels.codec_many` (many tensors per launch) all write bitstreams with
:func:`_put_code` and read them with :func:`_window` (the lossy decoder through
:func:`_next_symbol`, one symbol at a time; the lossless one moves a whole step at a
time); they live here, below all three, so that none of the codec kernels imports
another in a circle.
"""

from __future__ import annotations

import triton
import triton.language as tl

from neutrain.kernels import interpreting

COUNTERS = {"count": 0, "count_fused": 0, "pack": 0, "decode": 0}
"""Kernel launches, so tests can assert that the fast path ran."""
COMPILED: dict = {}
"""Last compiled kernel per op (registers, PTX/SASS), for benchmarks/codec/codec.py's resource report."""


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
def _put_code(acc, filled, rel, entry, stream_tile):
    """Append one code (``entry`` = code | length << 24) to each lane's 32-bit accumulator.

    ``acc`` holds ``filled`` (< 32) bits, MSB-aligned: a code (<= 21 bits) either
    fits, or completes a word (stored) and leaves its low ``over`` bits behind.
    """
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
    return acc, filled, rel + emit.to(tl.int32)


@triton.jit
def _window(w0, w1, shift, FUNNEL: tl.constexpr):
    """The 32 stream bits from bit ``shift`` (0..31) of ``w0`` on: ``w0 << shift | w1 >> (32 - shift)``.

    ``FUNNEL``: one funnel-shift instruction (PTX ``shf.l.clamp``) instead of five; the
    interpreter, which runs no PTX, takes the split shift (defined at ``shift = 0`` too).
    """
    if FUNNEL:
        return tl.inline_asm_elementwise("shf.l.clamp.b32 $0, $1, $2, $3;", "=r,r,r,r", [w1, w0, shift],
                                         dtype=tl.uint32, is_pure=True, pack=1)
    else:
        return (w0 << shift) | ((w1 >> 1) >> (31 - shift))


@triton.jit
def _next_symbol(w0, w1, w2, pos, rel, valid, lut_ptr, stream_tile, FUNNEL: tl.constexpr):
    """Decode one symbol per lane and move the lane's window along.

    w0:w1 hold the bits being read (from bit ``pos`` of w0); w2 is the next word,
    loaded one word ahead so that no load sits on the decode dependency chain.
    """
    window = _window(w0, w1, pos.to(tl.uint32), FUNNEL)
    # Zero-extended: the entry (symbol | length << 9) is never negative, and this saves a sign extension.
    entry = tl.load(lut_ptr + (window >> 20).to(tl.int32)).to(tl.uint16, bitcast=True).to(tl.int32)
    sym = entry & 0x1FF
    length = entry >> 9
    literal = ((window << length.to(tl.uint32)) >> 23).to(tl.int32)
    escaped = sym == 257
    sym = tl.where(escaped, literal, sym)
    pos += tl.where(escaped, length + 9, length)
    # A symbol takes at most 21 bits, so at most one word is crossed per symbol.
    crossed = pos >= 32
    pos = tl.where(crossed, pos - 32, pos)
    advance = crossed & valid  # lanes past the tensor's end stop reading
    ahead = tl.load(stream_tile + rel, mask=advance, other=0).to(tl.uint32, bitcast=True)
    w0 = tl.where(advance, w1, w0)
    w1 = tl.where(advance, w2, w1)
    w2 = tl.where(advance, ahead, w2)
    return sym, w0, w1, w2, pos, rel + advance.to(tl.int32)


PREFETCH_STATUS = {"broken": None}
"""Set to the error text if a prefetching kernel failed to compile; kernels then run without."""


def _prefetch(requested: bool | None) -> bool:
    # Off by default: on an H200 it sped up 16M-element decodes (285 vs 236 GB/s) but
    # slowed larger ones (521 vs 606 GB/s) by adding instructions to an
    # instruction-bound loop (benchmarks/codec/NOTES.md). Never in the interpreter,
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
    # 512 lanes (benchmarks/codec/NOTES.md).
    return num_warps or max(1, min(16, lanes // 32))


def _block_steps(steps: int, per_step: int) -> int:
    """Steps per count iteration: ~4096 elements, and a power of two dividing ``steps``."""
    block = 1
    while block * 2 * per_step <= 4096 and steps % (block * 2) == 0:
        block *= 2
    return block
