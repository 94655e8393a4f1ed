"""Compiled CPU codec: the LIH format of :mod:`neutrain.compress.codec`, one thread per tile.

The pure PyTorch reference (:func:`~neutrain.compress.codec.decode_tiles`,
:func:`~neutrain.compress.codec.count_lanes`, :func:`~neutrain.compress.codec.pack_lanes`)
stays the specification; this module writes and reads the same bytes with a scalar
bit reader/writer per lane, compiled by numba (``pip install "neutrain[cpu]"``) and
run in parallel over tiles. On a CPU each lane's bitstream is a short sequential
loop over cached data, so the work is a few operations per element instead of a
dozen whole-tensor PyTorch passes over ``int64`` temporaries.

Why numba rather than a C++ extension: it needs no compiler on the user's machine,
its kernels are cached on disk after the first call (``cache=True``, one process writing at a time:
:mod:`neutrain.compat.numba_cache`), and it is an
optional extra: without it (or with ``NEUTRAIN_CPU_CODEC=torch``) the PyTorch
path runs unchanged. Measurements are in ``benchmarks/codec/NOTES.md``.

For lossless bf16 (the CPU training hot path) encode and decode are fused with the
byte split of :func:`~neutrain.compress.layout.split_bf16_bytes`: the kernels read
and write bf16 bit patterns and the tail bytes directly. Other layouts go through
symbols, with the layout's own split/merge formulas around the kernels.

Example:
    >>> import torch
    >>> from neutrain.compress import compress
    >>> x = torch.randn(300, 70).bfloat16()
    >>> ct = compress(x)  # on CPU this runs here when numba is installed
    >>> torch.equal(ct.decompress().view(torch.int16), x.view(torch.int16))
    True
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from neutrain.compat.numba_cache import cached_njit
from neutrain.compress.codec import STREAM_PAD_WORDS
from neutrain.config.knobs import knob
from neutrain.compress.huffman import ESCAPE, LITERAL_BITS, MAX_CODE_BITS, NAN_SYMBOL
from neutrain.compress.layout import Layout, splits_bytewise

try:  # optional: the PyTorch path runs without it
    import numba
    from numba import prange
except ImportError:  # pragma: no cover - exercised where numba is absent
    numba = None

PARALLEL_MIN_ELEMENTS = 1 << 16
"""Smaller tensors (about two tiles or fewer) run on one thread: there a parallel region's wake-up
of every worker costs more than it gains. On a quiet 2-core machine two threads decode 0.1-1.3M
elements 1.6-2x faster than one; on one loaded ~9x over, waiting for descheduled workers made
them 3-15x slower (benchmarks/codec/NOTES.md)."""
fast_decodes = 0
"""Calls that decoded through the compiled kernels (tests check that the fast path ran)."""
fast_encodes = 0
"""Encodes (count + pack) that ran through the compiled kernels."""


def available() -> bool:
    """Whether the compiled CPU codec can run: numba importable and not disabled.

    ``NEUTRAIN_CPU_CODEC=torch`` forces the PyTorch path (to compare or to rule the kernels out).
    """
    return numba is not None and knob("NEUTRAIN_CPU_CODEC") != "torch"


def enabled(device: torch.device, backend: str) -> bool:
    """Whether ``backend`` on ``device`` runs the compiled kernels ("auto" on CPU, when available)."""
    return backend == "auto" and device.type == "cpu" and available()


if numba is not None:

    @cached_njit(inline="always")
    def _symbol(values, i, bf16_bits):
        v = np.int64(values[i])
        return (v >> 7) & 0xFF if bf16_bits else v

    @cached_njit(inline="always")
    def _row(t, s, lane, steps, lanes, elems, numel):
        """First element of ``lane`` at step ``s`` of tile ``t``, and how many of its ``elems`` exist."""
        base = (t * steps + s) * lanes * elems + lane * elems
        return base, max(0, min(elems, numel - base))

    @cached_njit(parallel=True)
    def _count(values, bf16_bits, numel, enc, steps, lanes, elems, lane_words, tile_bits, tails):
        """Pass 1: word count per lane and coded bits per tile; for bf16 bits also the tail bytes."""
        for t in prange(tile_bits.shape[0]):
            total = 0
            for lane in range(lanes):
                bits = 0
                for s in range(steps):
                    base, n = _row(t, s, lane, steps, lanes, elems, numel)
                    for i in range(base, base + n):
                        bits += enc[_symbol(values, i, bf16_bits)] >> 24
                        if bf16_bits:
                            v = values[i]
                            tails[i] = ((v >> 8) & 0x80) | (v & 0x7F)
                lane_words[t * lanes + lane] = (bits + 31) >> 5
                total += bits
            tile_bits[t] = total

    @cached_njit(parallel=True)
    def _pack(values, bf16_bits, numel, enc, steps, lanes, elems, lane_words, tile_base, stream):
        """Pass 2: each lane's codes MSB-first into 32-bit words, the last one padded with zeros."""
        for t in prange(tile_base.shape[0] - 1):
            word = tile_base[t]
            for lane in range(lanes):
                acc = np.int64(0)  # pending bits, right-aligned; never more than 31 + 21
                pending = 0
                for s in range(steps):
                    base, n = _row(t, s, lane, steps, lanes, elems, numel)
                    for i in range(base, base + n):
                        entry = np.int64(enc[_symbol(values, i, bf16_bits)])
                        length = entry >> 24
                        acc = (acc << length) | (entry & 0xFFFFFF)
                        pending += length
                        if pending >= 32:
                            pending -= 32
                            stream[word] = np.uint32((acc >> pending) & 0xFFFFFFFF)
                            word += 1
                            acc &= (np.int64(1) << pending) - 1
                if pending:
                    stream[word] = np.uint32((acc << (32 - pending)) & 0xFFFFFFFF)
                    word += 1

    @cached_njit(inline="always")
    def _merge(symbol, tail, width, exp_bits, mant, kept):
        """:func:`~neutrain.compress.layout.merge` for one element (tails of at most 8 bits)."""
        drop = mant - kept
        mag = (symbol << mant) | ((tail & ((np.int64(1) << kept) - 1)) << drop)
        if drop and symbol == NAN_SYMBOL:
            mag = (((np.int64(1) << exp_bits) - 1) << mant) | (np.int64(1) << (mant - 1))
        return (((tail >> kept) & 1) << (width - 1)) | mag

    @cached_njit(parallel=True)
    def _split(bits, width, exp_bits, mant, kept, symbols, tails):
        """:func:`~neutrain.compress.layout.split` plus :func:`~neutrain.compress.layout.pack_tails`
        (tails of at most 8 bits), one output byte of tails per iteration."""
        numel = bits.shape[0]
        tail_bits = kept + 1
        per_byte = 8 // tail_bits
        drop = mant - kept
        inf = ((np.int64(1) << exp_bits) - 1) << mant
        for b in prange(tails.shape[0]):
            byte = np.int64(0)
            for j in range(per_byte):
                i = b * per_byte + j
                if i >= numel:
                    break
                v = np.int64(bits[i])
                sign = v >> (width - 1)
                mag = v & ((np.int64(1) << (width - 1)) - 1)
                if drop == 0:
                    symbol = mag >> mant
                    kept_mant = mag & ((np.int64(1) << mant) - 1)
                elif mag > inf:  # NaN: no mantissa bit may be left to tell it from Inf
                    symbol = np.int64(NAN_SYMBOL)
                    kept_mant = np.int64(0)
                else:  # round half to even on the magnitude; a carry ripples into the exponent
                    rounded = mag
                    if mag != inf:
                        lsb = (mag >> drop) & 1
                        rounded = ((mag + (np.int64(1) << (drop - 1)) - 1 + lsb) >> drop) << drop
                        rounded = min(rounded, inf - (np.int64(1) << drop))  # saturate, never Inf
                    symbol = rounded >> mant
                    kept_mant = (rounded & ((np.int64(1) << mant) - 1)) >> drop
                symbols[i] = symbol
                byte |= ((sign << kept) | kept_mant) << (j * tail_bits)
            tails[b] = byte

    @cached_njit(parallel=True)
    def _decode(stream, lane_words, tile_base, lut, numel, steps, lanes, elems, tiles, out, fused, tails,
                width, exp_bits, mant, kept):
        """Decode ``tiles``. ``fused``: bit patterns into ``out[element]``, merged with the packed ``tails``
        (``kept + 1`` bits each); else symbols into ``out[k * tile_len + offset]`` for the k-th listed tile
        (0 past ``numel``)."""
        tile_len = steps * lanes * elems
        tail_bits = kept + 1
        per_byte = 8 // tail_bits
        for k in prange(tiles.shape[0]):
            t = tiles[k]
            word = tile_base[t]
            for lane in range(lanes):
                acc = np.int64(0)  # unread bits, right-aligned
                avail = 0
                pos = word
                for s in range(steps):
                    base, n = _row(t, s, lane, steps, lanes, elems, numel)
                    first = k * tile_len + base - t * tile_len  # where the symbols of a listed tile go
                    if not fused:
                        out[first + n : first + elems] = 0  # not coded: past numel
                    for i in range(base, base + n):
                        if avail < 32:  # at most 21 bits per symbol: one refill always suffices
                            acc = ((acc & ((np.int64(1) << avail) - 1)) << 32) | np.int64(stream[pos])
                            pos += 1
                            avail += 32
                        entry = np.int64(lut[(acc >> (avail - MAX_CODE_BITS)) & 0xFFF])
                        symbol = entry & 0x1FF
                        length = entry >> 9
                        if symbol == ESCAPE:
                            symbol = (acc >> (avail - length - LITERAL_BITS)) & 0x1FF
                            length += LITERAL_BITS
                        avail -= length
                        if fused:
                            tail = np.int64(tails[i // per_byte]) >> ((i % per_byte) * tail_bits)
                            tail &= (1 << tail_bits) - 1
                            out[i] = _merge(symbol, tail, width, exp_bits, mant, kept)
                        else:
                            out[first + i - base] = symbol
                word += lane_words[t * lanes + lane]


@contextmanager
def _threads(numel: int):
    """One numba thread below :data:`PARALLEL_MIN_ELEMENTS`, the configured number above."""
    if numel >= PARALLEL_MIN_ELEMENTS:
        yield
        return
    previous = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(previous)


def fuses(layout: Layout) -> bool:
    """Whether the kernels split and merge ``layout`` themselves: tails of at most 8 bits (all but
    lossless fp16 and fp32, whose symbols still go through the kernels)."""
    return not layout.top_byte and layout.tail_bits <= 8


def _bits(x: torch.Tensor) -> np.ndarray:
    """The unsigned bit patterns of a contiguous float tensor, as a shared numpy view."""
    flat = x.reshape(-1)
    if x.element_size() == 2:
        return flat.view(torch.int16).numpy().view(np.uint16)
    return flat.view(torch.int32).numpy().view(np.uint32)


def _layout_args(layout: Layout) -> tuple[int, int, int, int]:
    return layout.width, layout.exp_bits, layout.mant_bits, layout.kept


def encode(ct, x: torch.Tensor, symbols: torch.Tensor | None = None) -> tuple[int, int]:
    """Pass 1 of encoding contiguous ``x`` into ``ct``: lane words, tile table and (for :func:`fuses`
    layouts, when ``symbols`` is None) the packed tails. Returns (stream words incl. padding,
    coded bits), like ``CompressedTensor._count_reference``; :func:`pack` then writes the stream.

    ``symbols`` (from :func:`~neutrain.compress.layout.split`) is for the other layouts, whose
    tails the caller stores.
    """
    global fast_encodes
    fast_encodes += 1
    bf16_bits = symbols is None and splits_bytewise(ct.layout, ct.device)
    tile_bits = np.zeros(ct.tiles, dtype=np.int64)
    tails = ct.tails.numpy() if bf16_bits else np.zeros(1, dtype=np.uint8)
    with _threads(ct.numel):
        if bf16_bits:  # one pass reads the bf16 bytes: symbols, tails and lengths
            values = _bits(x)
        elif symbols is None:
            values = np.empty(ct.numel, dtype=np.uint16)
            _split(_bits(x), *_layout_args(ct.layout), values, ct._tails_view().numpy())
        else:
            values = symbols.to(torch.int16).numpy().view(np.uint16)
        ct._pending_symbols = (values, bf16_bits)
        _count(values, bf16_bits, ct.numel, ct.enc_table.numpy(), ct.steps, ct.lanes, ct.elems,
               ct.lane_words.numpy(), tile_bits, tails)
    tile_base = ct.tile_base.numpy()
    tile_base[0] = 0
    np.cumsum(ct.lane_words.numpy().reshape(-1, ct.lanes).sum(axis=1, dtype=np.int64), out=tile_base[1:])
    return int(tile_base[-1]) + STREAM_PAD_WORDS, int(tile_bits.sum())


def pack(ct, pending) -> None:
    """Pass 2: the stream of ``ct`` from what :func:`encode` left (the padding words are the caller's)."""
    values, bf16_bits = pending
    with _threads(ct.numel):
        _pack(values, bf16_bits, ct.numel, ct.enc_table.numpy(), ct.steps, ct.lanes, ct.elems,
              ct.lane_words.numpy(), ct.tile_base.numpy(), ct.stream.numpy().view(np.uint32))


def _run_decode(ct, tiles: np.ndarray, out: np.ndarray, fused: bool) -> None:
    global fast_decodes
    fast_decodes += 1
    tails = ct._tails_view().numpy() if fused else np.zeros(1, dtype=np.uint8)
    with _threads(tiles.shape[0] * ct.steps * ct.lanes * ct.elems):
        _decode(ct.stream.numpy().view(np.uint32), ct.lane_words.numpy(), ct.tile_base.numpy(), ct.lut.numpy(),
                ct.numel, ct.steps, ct.lanes, ct.elems, tiles, out, fused, tails, *_layout_args(ct.layout))


def decode_into(ct, out: torch.Tensor) -> torch.Tensor:
    """A :func:`fuses` layout: decode ``ct`` straight into the contiguous ``out`` (symbols and tails merged)."""
    _run_decode(ct, np.arange(ct.tiles, dtype=np.int64), _bits(out), True)
    return out


def decode_symbols(ct, tiles: torch.Tensor | None = None) -> torch.Tensor:
    """The symbols of ``tiles`` (default: all) as ``int32``, equal to
    :func:`~neutrain.compress.codec.decode_tiles_jumping`."""
    order = np.arange(ct.tiles, dtype=np.int64) if tiles is None else tiles.to(torch.int64).reshape(-1).numpy()
    out = np.empty(order.shape[0] * ct.steps * ct.lanes * ct.elems, dtype=np.int32)
    _run_decode(ct, order, out, False)
    return torch.from_numpy(out)
