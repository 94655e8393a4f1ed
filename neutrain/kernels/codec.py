"""Triton kernels of the NeuZip codec, lossless bf16: encode in two passes, decode in one.

The format and its pure-PyTorch reference live in :mod:`neutrain.compress.codec`
and :mod:`neutrain.compress.layout`; these kernels produce and read the same
bytes (the tests compare them bit for bit). One program handles one tile of
``S * L * E`` elements; its ``L`` lanes run side by side and walk the ``S``
steps in a loop, so every load and store of weights, tails and outputs is
coalesced, while each lane reads or writes its own bitstream. Lossless tensors use
``E = 4`` elements per lane and step: one 4-byte tail access and one 8-byte weight
access per lane and step, the step's bookkeeping shared by 4 symbols. The lossy
modes live in :mod:`neutrain.kernels.codec_lossy`, the grouped (many tensors per
launch) kernels in :mod:`neutrain.kernels.codec_many`; both reuse the per-tile code
here.

* :func:`count_lossless` (pass 1): sum code lengths per lane; write lane word counts
  and per-tile word and bit totals, and (a second small kernel) their prefix sums, the
  tile bases. Both passes launch through :class:`~neutrain.kernels.launch.Launcher`:
  a re-encode costs little host time, so small matrices run at their kernels' speed.
  After a fused LOMO update the lane counts were summed inside the update
  (:func:`_add_lane_bits`) and :func:`finish_count` replaces this pass.
* :func:`pack_lossless` (pass 2): checks on the device that the new stream fits the
  allocated capacity; if so each lane writes its tails and packs its codes MSB-first
  through a 32-bit accumulator, storing a word whenever 32 bits are ready, and the
  tile commits its lane counts and tile base; otherwise nothing changes and a flag is
  raised (:mod:`neutrain.compress.stream`). No host read is needed.
* :func:`decode`: each lane moves along its stream once per step, not once per symbol:
  it holds four 32-bit words and a bit offset, funnels the 96 bits from there into
  three registers, and takes each of the step's (at most 4 x 21 = 84) bits of symbols
  from the top of them (12 bits into the 8 KiB decode LUT, L1-resident; a 9-bit
  literal after an escape), shifting them left by the symbol's length. At the step's
  end the words move by the 0..3 whole words read (the first loaded a step ahead),
  and the lane stores its 4 values as one 8-byte word. All per-step arithmetic is
  32-bit: the loop is bound by instruction issue and, for small tensors, by each
  lane's chain. SASS for sm_90 (Triton 3.9, compiled on a CPU): 125 instructions per
  step, against 172 with a word advance per symbol and the [L, 4] store through
  shared memory (benchmarks/codec/NOTES.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from neutrain.kernels import codec_lossy, interpreting
from neutrain.kernels.codec_common import COMPILED, COUNTERS, _block_steps, _num_warps, _put_code, _window
from neutrain.kernels.launch import Launcher


@triton.jit
def _tails_words(tails_tile, E: tl.constexpr):
    """A tile's tail bytes as one E-byte word per lane and step (the buffer is padded to whole words)."""
    if E == 4:
        return tails_tile.to(tl.pointer_type(tl.int32))
    elif E == 2:
        return tails_tile.to(tl.pointer_type(tl.int16))
    else:
        return tails_tile


@triton.jit
def _bf16(tails, e: tl.constexpr, sym):
    """Element ``e`` of a lane's step: tail byte ``e`` (sign | mantissa) around the exponent ``sym``."""
    t = tails >> (8 * e)
    return ((t & 0x80) << 8) | (sym << 7) | (t & 0x7F)


@triton.jit
def _symbol(x, lut_ptr):
    """The symbol at the top of ``x`` (the next 32 stream bits; a symbol reads at most 21 of them) and
    how many bits it takes: a code (<= 12 bits) through the LUT, then a 9-bit literal after an escape."""
    # Zero-extended: the entry (symbol | length << 9) is never negative, and this saves a sign extension.
    entry = tl.load(lut_ptr + (x >> 20).to(tl.int32)).to(tl.uint16, bitcast=True).to(tl.int32)
    sym = entry & 0x1FF
    length = entry >> 9
    literal = ((x << length.to(tl.uint32)) >> 23).to(tl.int32)
    escaped = sym == 257
    return tl.where(escaped, literal, sym), tl.where(escaped, length + 9, length)


@triton.jit
def _opaque(lane, FUNNEL: tl.constexpr):
    """``lane``, hidden from Triton's contiguity analysis (a PTX ``mov``; the interpreter runs no PTX).

    Why: knowing that lanes' 8-byte words are contiguous, Triton gives each thread two of them
    (16-byte stores) and moves every step's values through shared memory (a layout conversion:
    two barriers a step); one 8-byte store per thread is coalesced just the same.
    """
    if FUNNEL:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [lane], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return lane


@triton.jit
def _word(words, i, load):
    """``words[i]`` as a uint32 where ``load``, else 0."""
    return tl.load(words + i, mask=load, other=0).to(tl.uint32, bitcast=True)


@triton.jit
def _pick(k, a, b, c, d):
    """``(a, b, c, d)[k]`` for ``k`` in 0..3 (three selects)."""
    return tl.where(k >= 2, tl.where(k >= 3, d, c), tl.where(k >= 1, b, a))


@triton.jit
def _decode_lossless(stream_ptr, lane_words_ptr, tile_base_ptr, tails_ptr, lut_ptr, out_tile, tile, N,
                     S: tl.constexpr, L: tl.constexpr, E: tl.constexpr, EVEN: tl.constexpr, FUNNEL: tl.constexpr,
                     PAIRS: tl.constexpr = False):
    """Lossless bf16 decode of one tile into ``out_tile``, E elements per lane and step:
    one E-byte tail load and one 2E-byte store per lane and step.

    The stream moves once per step, not per symbol. A lane holds four words ``a:b:c:d``
    and reads from bit ``pos`` (< 32) of ``a``; a step's E symbols take at most 21 E <= 84
    bits, all inside those 128. The step funnels the 96 bits from ``pos`` into ``x:y:z``
    and shifts them left by each symbol's length (the next symbol is always at the top of
    ``x``); at its end the words move along by ``k = pos // 32`` (0..3). The word after
    ``d`` is loaded ahead (its latency overlaps a step of decoding), as the per-symbol
    decoder did; a step that reads more than one new word (over 32 bits) is rare.

    Lanes past the tensor's end decode garbage that is never stored (a lane's valid steps
    come first, so nothing they read is used). Loads stay inside the lane's own words:
    past them a lane reads zeros, which at most fill the unused end of a LUT index.
    ``EVEN`` (``numel % E == 0``): a lane's E elements are all in the tensor or all past
    its end, so the store is one access. ``PAIRS`` (E = 4, ``EVEN``, ``out_tile`` 8-byte
    aligned): a lane stores its 4 values as one 8-byte word straight from registers; the
    [L, 4] block otherwise goes through shared memory to be stored (Triton 3.9 SASS: 4
    two-byte stores and 2 barriers a step). The tails are loaded a step ahead.
    """
    lane = tl.arange(0, L)
    count = tl.load(lane_words_ptr + tile * L + lane).to(tl.int32)
    rel = tl.cumsum(count, axis=0) - count  # the lane's first word, from the tile's first
    limit = rel + count  # past its last word a lane reads zeros: those bits never decide a stored symbol
    stream_tile = stream_ptr + tl.load(tile_base_ptr + tile)
    first_word = stream_tile + rel
    a = _word(first_word, 0, rel < limit)
    b = _word(first_word, 1, rel + 1 < limit)
    c = _word(first_word, 2, rel + 2 < limit)
    d = _word(first_word, 3, rel + 3 < limit)
    ahead = _word(first_word, 4, rel + 4 < limit)
    rel += 4  # ``ahead``'s word
    pos = tl.zeros([L], dtype=tl.int32)
    base = tile * (S * L * E)
    tails_words = _tails_words(tails_ptr + base, E)
    remaining = tl.minimum(N - base, S * L * E).to(tl.int32)
    upcoming = tl.load(tails_words + lane, mask=lane * E < remaining, other=0)
    out_words = out_tile.to(tl.pointer_type(tl.uint64))
    lane_word = _opaque(lane, FUNNEL)
    for s in range(S):
        first = s * (L * E) + lane * E
        tails = upcoming.to(tl.int32)
        upcoming = tl.load(tails_words + (s + 1) * L + lane, mask=first + L * E < remaining, other=0)
        shift = pos.to(tl.uint32)
        x = _window(a, b, shift, FUNNEL)
        sym, length = _symbol(x, lut_ptr)
        pos += length
        vals = _bf16(tails, 0, sym)
        if E >= 2:
            y = _window(b, c, shift, FUNNEL)
            if E == 4:
                # Each shift keeps only the bits the step's later symbols can still read.
                z = _window(c, d, shift, FUNNEL)
                step = length.to(tl.uint32)
                x = _window(x, y, step, FUNNEL)
                y = _window(y, z, step, FUNNEL)
                z = z << step
                sym, length = _symbol(x, lut_ptr)
                pos += length
                v1 = _bf16(tails, 1, sym)
                step = length.to(tl.uint32)
                x = _window(x, y, step, FUNNEL)
                y = _window(y, z, step, FUNNEL)
                sym, length = _symbol(x, lut_ptr)
                pos += length
                v2 = _bf16(tails, 2, sym)
                x = _window(x, y, length.to(tl.uint32), FUNNEL)
                sym, length = _symbol(x, lut_ptr)
                pos += length
                v3 = _bf16(tails, 3, sym)
                if PAIRS:  # the lane's 4 little-endian bf16 as one 64-bit word
                    low = (vals | (v1 << 16)).to(tl.uint32, bitcast=True).to(tl.uint64)
                    vals = low | ((v2 | (v3 << 16)).to(tl.uint32, bitcast=True).to(tl.uint64) << 32)
                else:
                    # join(join(v0, v2), join(v1, v3)) reshaped to [L, 4] is (v0, v1, v2, v3) per lane.
                    vals = tl.reshape(tl.join(tl.join(vals, v2), tl.join(v1, v3)), [L, 4])
            else:
                x = _window(x, y, length.to(tl.uint32), FUNNEL)
                sym, length = _symbol(x, lut_ptr)
                pos += length
                vals = tl.join(vals, _bf16(tails, 1, sym))
        else:
            vals = vals[:, None]
        # The words move along by the whole words the step read: at most 3 (pos < 32 + 84). The
        # first new one was loaded a step or more ago; a second and third (a step of long codes or
        # escapes: over 32 bits) are rare, so they load only when needed and wait here.
        k = pos >> 5
        pos &= 31
        here = stream_tile + rel  # ``ahead``'s word: one 64-bit address for the step's three loads
        n2 = _word(here, 1, (k >= 2) & (rel + 1 < limit))
        n3 = _word(here, 2, (k >= 3) & (rel + 2 < limit))
        a, b = _pick(k, a, b, c, d), _pick(k, b, c, d, ahead)
        c, d = _pick(k, c, d, ahead, n2), _pick(k, d, ahead, n2, n3)
        # The next ``ahead``, needed at the earliest at the next step's end: its latency overlaps that step.
        ahead = tl.where(k >= 1, _word(here, k, (k >= 1) & (rel + k < limit)), ahead)
        rel += k
        offset = first[:, None] + tl.arange(0, E)[None, :]
        if PAIRS:
            tl.store(out_words + s * L + lane_word, vals, mask=first < remaining)
        elif EVEN:
            tl.store(out_tile + offset, vals.to(tl.int16), mask=(first < remaining)[:, None])
        else:
            tl.store(out_tile + offset, vals.to(tl.int16), mask=offset < remaining)


@triton.jit
def _decode_wide_kernel(stream_ptr, lane_words_ptr, tile_base_ptr, tails_ptr, lut_ptr, tile_ids_ptr, out_ptr, N,
                        S: tl.constexpr, L: tl.constexpr, E: tl.constexpr, EVEN: tl.constexpr,
                        HAS_IDS: tl.constexpr, FUNNEL: tl.constexpr, PAIRS: tl.constexpr):
    """One tensor: program ``pid`` decodes tile ``pid`` (or ``tile_ids[pid]`` into slot ``pid``)."""
    pid = tl.program_id(0).to(tl.int64)
    if HAS_IDS:
        tile = tl.load(tile_ids_ptr + pid).to(tl.int64)
    else:
        tile = pid
    _decode_lossless(stream_ptr, lane_words_ptr, tile_base_ptr, tails_ptr, lut_ptr, out_ptr + pid * (S * L * E),
                     tile, N, S, L, E, EVEN, FUNNEL, PAIRS)


@triton.jit
def _count_lossless(x_tile, enc_ptr, counts_tile, words_ptr, bits_ptr, remaining,
                    S: tl.constexpr, L: tl.constexpr, E: tl.constexpr, BS: tl.constexpr):
    """Pass 1 of a lossless tile: each lane's word count (``counts_tile``), the tile's words and bits.

    Nothing here is sequential per lane (lengths are summed), so each iteration loads a
    ``[BS steps, L, E]`` block: many independent loads in flight, like a copy. Writes no
    tails: pass 2 does, once it knows the stream fits (see :func:`_pack_lossless`).
    """
    step = tl.arange(0, BS)[:, None, None]
    lane = tl.arange(0, L)[None, :, None]
    elem = tl.arange(0, E)[None, None, :]
    lane_bits = tl.zeros([L], dtype=tl.int32)
    for s0 in range(0, S, BS):
        offset = (s0 + step) * (L * E) + lane * E + elem
        valid = offset < remaining
        x = tl.load(x_tile + offset, mask=valid, other=0).to(tl.int32)
        entry = tl.load(enc_ptr + ((x >> 7) & 0xFF), mask=valid, other=0)
        lane_bits += tl.sum(tl.sum(entry >> 24, axis=2), axis=0)
    words = (lane_bits + 31) // 32
    tl.store(counts_tile + tl.arange(0, L), words.to(tl.uint8))
    tl.store(words_ptr, tl.sum(words, axis=0).to(tl.int64))
    tl.store(bits_ptr, tl.sum(lane_bits, axis=0).to(tl.int64))


@triton.jit
def _in_tile(offset, remaining, EVEN: tl.constexpr):
    """Mask of a ``[L, E]`` block's elements in the tensor: one test per lane (its first element) when
    ``EVEN``, so the lane's E elements load as one vector."""
    if EVEN:
        return tl.min(offset, axis=1, keep_dims=True) < remaining
    else:
        return offset < remaining


@triton.jit
def _pack_element(x, e: tl.constexpr, valid, tails, enc_ptr, acc, filled, rel, stream_tile):
    """One element of a lane's step: its tail byte into ``tails``, its exponent's code into the stream."""
    x = x.to(tl.int32)
    tails |= (((x >> 8) & 0x80) | (x & 0x7F)) << (8 * e)
    entry = tl.load(enc_ptr + ((x >> 7) & 0xFF), mask=valid, other=0)
    acc, filled, rel = _put_code(acc, filled, rel, entry, stream_tile)
    return tails, acc, filled, rel


@triton.jit
def _pack_lossless(x_tile, enc_ptr, counts_tile, cum_ptr, G, base_w, base_b, tile, tiles, capacity, stream_ptr,
                   tails_ptr, lane_words_ptr, tile_base_ptr, status_ptr, remaining,
                   S: tl.constexpr, L: tl.constexpr, E: tl.constexpr, EVEN: tl.constexpr):
    """Pass 2 of a lossless tile, committed only if the tensor's whole stream fits ``capacity``.

    ``cum_ptr`` points at the tensor's first tile in the inclusive prefix sums of pass 1
    (words; bits ``G`` entries further), ``base_w``/``base_b`` are the sums before it. If the
    stream fits, the tile writes its tails, its lanes' codes, its lane counts and its
    ``tile_base`` entry, and tile 0 writes the padding words and ``status[:2]`` (used words,
    coded bits); otherwise nothing is written but ``status[2] = 1`` (sticky until the host
    clears it): the tensor keeps its previous content, intact. So the encoder needs no
    host read to size the stream. A lane's E weights load as one vector, a step ahead.
    """
    total = tl.load(cum_ptr + tiles - 1) - base_w
    if total + 3 <= capacity:
        lane = tl.arange(0, L)
        count = tl.load(counts_tile + lane).to(tl.int32)
        start = tl.where(tile > 0, tl.load(cum_ptr + tl.maximum(tile - 1, 0)), base_w) - base_w
        rel = tl.cumsum(count, axis=0) - count  # lane start, in words from the tile's first word
        stream_tile = stream_ptr + start
        tails_words = _tails_words(tails_ptr + tile * (S * L * E), E)
        acc = tl.zeros([L], dtype=tl.uint32)
        filled = tl.zeros([L], dtype=tl.int32)
        offset = lane[:, None] * E + tl.arange(0, E)[None, :]
        upcoming = tl.load(x_tile + offset, mask=_in_tile(offset, remaining, EVEN), other=0)
        for s in range(S):
            first = s * (L * E) + lane * E
            xs = upcoming
            ahead = offset + (s + 1) * (L * E)
            upcoming = tl.load(x_tile + ahead, mask=_in_tile(ahead, remaining, EVEN), other=0)
            v0 = first < remaining
            tails = tl.zeros([L], dtype=tl.int32)
            if E == 4:
                even, odd = tl.split(tl.reshape(xs, [L, 2, 2]))  # columns (0, 2) and (1, 3)
                x0, x2 = tl.split(even)
                x1, x3 = tl.split(odd)
                tails, acc, filled, rel = _pack_element(x0, 0, v0, tails, enc_ptr, acc, filled, rel, stream_tile)
                v = v0 if EVEN else first + 1 < remaining
                tails, acc, filled, rel = _pack_element(x1, 1, v, tails, enc_ptr, acc, filled, rel, stream_tile)
                v = v0 if EVEN else first + 2 < remaining
                tails, acc, filled, rel = _pack_element(x2, 2, v, tails, enc_ptr, acc, filled, rel, stream_tile)
                v = v0 if EVEN else first + 3 < remaining
                tails, acc, filled, rel = _pack_element(x3, 3, v, tails, enc_ptr, acc, filled, rel, stream_tile)
                tl.store(tails_words + s * L + lane, tails, mask=v0)
            elif E == 2:
                x0, x1 = tl.split(xs)
                tails, acc, filled, rel = _pack_element(x0, 0, v0, tails, enc_ptr, acc, filled, rel, stream_tile)
                v = v0 if EVEN else first + 1 < remaining
                tails, acc, filled, rel = _pack_element(x1, 1, v, tails, enc_ptr, acc, filled, rel, stream_tile)
                tl.store(tails_words + s * L + lane, tails.to(tl.int16), mask=v0)
            else:
                tails, acc, filled, rel = _pack_element(tl.reshape(xs, [L]), 0, v0, tails, enc_ptr, acc, filled,
                                                        rel, stream_tile)
                tl.store(tails_words + s * L + lane, tails.to(tl.uint8), mask=v0)
        tl.store(stream_tile + rel, acc.to(tl.int32, bitcast=True), mask=filled > 0)
        tl.store(lane_words_ptr + tile * L + lane, count.to(tl.uint8))
        tl.store(tile_base_ptr + tile + 1, tl.load(cum_ptr + tile) - base_w)
        if tile == 0:
            pad = tl.arange(0, 4)
            tl.store(stream_ptr + total + pad, tl.zeros([4], dtype=tl.int32), mask=pad < 3)
            tl.store(status_ptr, total + 3)
            tl.store(status_ptr + 1, tl.load(cum_ptr + G + tiles - 1) - base_b)
    else:
        if tile == 0:
            tl.store(status_ptr + 2, 1)


@triton.jit
def _count_wide_kernel(x_ptr, enc_ptr, counts_ptr, scratch_ptr, G, N,
                       S: tl.constexpr, L: tl.constexpr, E: tl.constexpr, BS: tl.constexpr):
    """Pass 1 of one lossless tensor: lane counts, and tile words / bits at ``scratch[tile]`` / ``[G + tile]``."""
    tile = tl.program_id(0).to(tl.int64)
    base = tile * (S * L * E)
    _count_lossless(x_ptr + base, enc_ptr, counts_ptr + tile * L, scratch_ptr + tile, scratch_ptr + G + tile,
                    tl.minimum(N - base, S * L * E).to(tl.int32), S, L, E, BS)


@triton.jit
def _pack_wide_kernel(x_ptr, enc_ptr, counts_ptr, cum_ptr, G, capacity, stream_ptr, tails_ptr, lane_words_ptr,
                      tile_base_ptr, status_ptr, N, S: tl.constexpr, L: tl.constexpr, E: tl.constexpr,
                      EVEN: tl.constexpr):
    """Pass 2 of one lossless tensor (its ``G`` tiles)."""
    tile = tl.program_id(0).to(tl.int64)
    base = tile * (S * L * E)
    _pack_lossless(x_ptr + base, enc_ptr, counts_ptr + tile * L, cum_ptr, G, 0, 0, tile, G, capacity, stream_ptr,
                   tails_ptr, lane_words_ptr, tile_base_ptr, status_ptr, tl.minimum(N - base, S * L * E).to(tl.int32),
                   S, L, E, EVEN)



_SCAN_BLOCK = 1024


@triton.jit
def _scan_tiles_kernel(scratch_ptr, cum_ptr, G, BLOCK: tl.constexpr):
    """Inclusive prefix sums of row ``program_id`` of ``int64[2, G]`` (tile words, tile bits): the pack
    pass's tile bases and totals. A kernel of its own, launched without Triton's dispatch, because
    ``torch.cumsum`` cost more host time per encode than the launch of a whole pass."""
    row = tl.program_id(0).to(tl.int64) * G
    carry = tl.zeros([], dtype=tl.int64)
    for start in range(0, G, BLOCK):
        index = start + tl.arange(0, BLOCK)
        values = tl.load(scratch_ptr + row + index, mask=index < G, other=0)
        tl.store(cum_ptr + row + index, tl.cumsum(values, axis=0) + carry, mask=index < G)
        carry += tl.sum(values, axis=0)


@triton.jit
def _add_lane_bits(bits, first, valid, enc_ptr, lane_bits_ptr, T, L: tl.constexpr, E: tl.constexpr,
                   GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 1 fed from another kernel's registers: add the code lengths of ``BLOCK`` bf16 patterns
    ``bits`` (elements ``first ...`` of the whole tensor, ``valid`` where they exist) to their lanes'
    bit counts ``lane_bits[tile * L + lane]`` (int32; atomics, so any kernel grid may call it).

    ``GROUP`` consecutive elements (``E``, or 1 when ``first`` is not a multiple of ``E``) share a
    lane, so their lengths are summed before one atomic. Integer sums in any order: the counts are
    those of :func:`_count_lossless`, bit for bit; :func:`finish_count` turns them into its outputs.
    """
    lengths = tl.load(enc_ptr + ((bits.to(tl.int32) >> 7) & 0xFF), mask=valid, other=0) >> 24
    lengths = tl.sum(tl.reshape(lengths, [BLOCK // GROUP, GROUP]), axis=1)
    start = first + tl.arange(0, BLOCK // GROUP).to(tl.int64) * GROUP
    lane = (start // T) * L + (start % T) % (L * E) // E
    any_valid = tl.sum(tl.reshape(valid.to(tl.int32), [BLOCK // GROUP, GROUP]), axis=1) > 0
    tl.atomic_add(lane_bits_ptr + lane, lengths, mask=any_valid, sem="relaxed")


@triton.jit
def _finish_count_kernel(lane_bits_ptr, counts_ptr, scratch_ptr, G, L: tl.constexpr):
    """Pass 1's outputs for tile ``program_id`` from lane bit counts (:func:`_add_lane_bits`),
    which it sets back to zero for the next update."""
    tile = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, L)
    lane_bits = tl.load(lane_bits_ptr + tile * L + lane)
    words = (lane_bits + 31) // 32
    tl.store(counts_ptr + tile * L + lane, words.to(tl.uint8))
    tl.store(scratch_ptr + tile, tl.sum(words, axis=0).to(tl.int64))
    tl.store(scratch_ptr + G + tile, tl.sum(lane_bits, axis=0).to(tl.int64))
    tl.store(lane_bits_ptr + tile * L + lane, tl.zeros([L], dtype=tl.int32))


_COUNT = Launcher(_count_wide_kernel)
_SCAN = Launcher(_scan_tiles_kernel)
_PACK = Launcher(_pack_wide_kernel)
_FINISH = Launcher(_finish_count_kernel)
_DECODE = Launcher(_decode_wide_kernel)


def count_lossless(x: torch.Tensor, enc_table, counts, scratch, steps, lanes, elems, num_warps=None, cum=None):
    """Lossless pass 1: lane word counts into ``counts`` (``uint8[tiles * lanes]``), tile words and bits
    into ``scratch`` (``int64[2, tiles]``), and (given ``cum``, same shape) their inclusive prefix sums
    along dim 1, which :func:`pack_lossless` reads."""
    tiles = scratch.shape[1]
    if tiles:
        COMPILED["count"] = _COUNT(
            (tiles,), (x.view(torch.int16), enc_table, counts, scratch, tiles, x.numel()),
            {"S": steps, "L": lanes, "E": elems, "BS": _block_steps(steps, lanes * elems)},
            num_warps=_num_warps(lanes, num_warps))
        if cum is not None:
            _SCAN((2,), (scratch, cum, tiles), {"BLOCK": _SCAN_BLOCK}, num_warps=4)
    COUNTERS["count"] += 1


def finish_count(lane_bits, counts, scratch, cum, lanes):
    """Pass 1 from lane bit counts summed inside another kernel (``int32[tiles * lanes]``, left zeroed):
    the outputs of :func:`count_lossless`, ``cum`` included."""
    tiles = scratch.shape[1]
    if tiles:
        _FINISH((tiles,), (lane_bits, counts, scratch, tiles), {"L": lanes}, num_warps=_num_warps(lanes, None))
        _SCAN((2,), (scratch, cum, tiles), {"BLOCK": _SCAN_BLOCK}, num_warps=4)
    COUNTERS["count_fused"] += 1


def pack_lossless(x: torch.Tensor, enc_table, counts, cum, capacity: int, stream, tails, lane_words, tile_base,
                  status, steps, lanes, elems, num_warps=None):
    """Lossless pass 2 from ``cum`` (``scratch`` after an inclusive ``cumsum`` along dim 1): commits the
    new encoding (tails, stream, lane counts, tile table, ``status``) only if it fits ``capacity`` words."""
    tiles = cum.shape[1]
    if tiles:
        COMPILED["pack"] = _PACK(
            (tiles,), (x.view(torch.int16), enc_table, counts, cum, tiles, capacity, stream, tails, lane_words,
                       tile_base, status, x.numel()),
            {"S": steps, "L": lanes, "E": elems, "EVEN": x.numel() % elems == 0},
            num_warps=_num_warps(lanes, num_warps))
    COUNTERS["pack"] += 1


def decode(stream, lane_words, tile_base, tails, lut, out: torch.Tensor, numel, steps, lanes, kept, elems=1,
           tile_ids: torch.Tensor | None = None, num_warps=None, prefetch=None):
    """Decode all tiles (or ``tile_ids``, each into its own ``S * L * E`` slot of ``out``) into bf16 ``out``."""
    programs = tile_base.numel() - 1 if tile_ids is None else tile_ids.numel()
    if programs:
        ids = tile_base if tile_ids is None else tile_ids  # any pointer will do when unused
        if kept == 7:
            # Through the compiled launcher (kernels.launch): training decodes each weight up to three times
            # a step, and at batch 1 Triton's dispatch (~70 us a launch on an H200 host) outlasted the decode.
            COMPILED["decode"] = _DECODE(
                (programs,), (stream, lane_words, tile_base, tails, lut, ids, out.view(torch.int16), numel),
                {"S": steps, "L": lanes, "E": elems, "EVEN": numel % elems == 0, "HAS_IDS": tile_ids is not None,
                 "FUNNEL": not interpreting(), "PAIRS": elems == 4 and numel % 4 == 0 and out.data_ptr() % 8 == 0},
                num_warps=_num_warps(lanes, num_warps))
        else:
            assert elems == 1, "lossy tails pack across lanes: one element per lane and step"
            codec_lossy.decode(stream, lane_words, tile_base, tails, lut, out, numel, steps, lanes, kept, ids,
                               tile_ids is not None, num_warps, prefetch)
    COUNTERS["decode"] += 1
