"""Reference (pure PyTorch) lane-interleaved Huffman codec: the specification.

Layout ("LIH", codec.md sections 6 and 8). The flat tensor is cut into tiles of
``S * L * E`` elements (steps, lanes, elements per lane and step); element
``tile * S*L*E + s * L*E + l * E + e`` belongs to lane ``l`` of that tile, which
codes the symbols of its elements in the order ``(s, e)``. So at every step the
lanes of a tile touch ``L * E`` consecutive elements (coalesced loads and stores
on a GPU, ``E`` of them per thread), while each lane codes its own ``S * E``
symbols one after the other. ``E > 1`` amortises a step's bookkeeping (offsets,
masks, a vector load and store) over several symbols:

* each lane writes an MSB-first bitstream of 32-bit words, padded with zero bits
  to a whole word. A code never exceeds 21 bits (12-bit code + 9-bit escape
  literal), so a lane of 256 symbols fits 168 words and its count fits a byte;
* ``lane_words`` (``uint8[tiles * lanes]``) holds each lane's word count;
* ``tile_base`` (``int64[tiles + 1]``) is the exclusive prefix sum of the tiles'
  word counts, its last entry the total. A lane's first word is
  ``tile_base[tile] + sum(lane_words[tile, :l])``: the decoder finds it with one
  in-tile prefix sum, so no per-lane offset table is stored (8 bits per lane
  instead of 32: 0.03 instead of 0.125 bit/weight at S = 256);
* the stream (``int32``) carries three zero words after the last one, so a
  decoder may always read three words ahead.

Elements past the end of the tensor in the last tile are not coded.

The encoder runs in two passes, like the Triton kernels: :func:`count_lanes`
(code lengths per lane) and :func:`pack_lanes` (bits into words); in between the
caller sizes the stream from ``tile_base[-1]``. :func:`decode_tiles` parses all
lanes of the requested tiles in lock-step, one vectorised step at a time.
"""

from __future__ import annotations

import torch

from neutrain.compress.huffman import ESCAPE, LITERAL_BITS, MAX_CODE_BITS

STREAM_PAD_WORDS = 3
"""Zero words after the last lane, so a decoder reading three words ahead stays in bounds."""

_LEN_SHIFT_ENC = 24
_CODE_MASK = (1 << _LEN_SHIFT_ENC) - 1


def num_tiles(numel: int, steps: int, lanes: int, elems: int = 1) -> int:
    """Tiles needed for ``numel`` elements."""
    return -(-numel // (steps * lanes * elems))


def _lane_view(symbols: torch.Tensor, steps: int, lanes: int, elems: int, fill: int) -> torch.Tensor:
    """Pad flat symbols to whole tiles and view them in coding order: ``[tiles, steps * elems, lanes]``."""
    tiles = num_tiles(symbols.numel(), steps, lanes, elems)
    padded = torch.full((tiles * steps * lanes * elems,), fill, dtype=torch.int64, device=symbols.device)
    padded[: symbols.numel()] = symbols
    return padded.view(tiles, steps, lanes, elems).transpose(2, 3).reshape(tiles, steps * elems, lanes)


def _codes_and_lengths(symbols, enc_table, steps, lanes, elems):
    """Per-element (code, length) as ``[tiles, steps * elems, lanes]``; padding has length 0."""
    table = torch.cat([enc_table.to(torch.int64), torch.zeros(1, dtype=torch.int64, device=enc_table.device)])
    entries = _take(table, _lane_view(symbols, steps, lanes, elems, fill=table.numel() - 1))
    return entries & _CODE_MASK, entries >> _LEN_SHIFT_ENC


def count_lanes(symbols: torch.Tensor, enc_table: torch.Tensor, steps: int, lanes: int, elems: int = 1):
    """Pass 1: each lane's word count and the tiles' word prefix sums.

    Args:
        symbols: Flat ``int64`` symbols.
        enc_table: ``int32[NUM_SYMBOLS]`` from :func:`~neutrain.compress.huffman.encode_table`.
        steps: Steps per lane (S).
        lanes: Lanes per tile (L).
        elems: Elements per lane and step (E).

    Returns:
        ``(lane_words uint8[tiles * lanes], tile_base int64[tiles + 1], coded_bits int64 scalar)``.
    """
    _, lengths = _codes_and_lengths(symbols, enc_table, steps, lanes, elems)
    lane_bits = lengths.sum(dim=1)
    lane_words = (lane_bits + 31) // 32
    tile_base = torch.zeros(lane_words.shape[0] + 1, dtype=torch.int64, device=symbols.device)
    torch.cumsum(lane_words.sum(dim=1), dim=0, out=tile_base[1:])
    return lane_words.to(torch.uint8).reshape(-1), tile_base, lane_bits.sum()


def lane_starts(lane_words: torch.Tensor, tile_base: torch.Tensor, tiles: torch.Tensor, lanes: int) -> torch.Tensor:
    """First word of every lane of ``tiles`` (``int64[len(tiles), lanes]``)."""
    counts = lane_words.view(-1, lanes)[tiles].to(torch.int64)
    return tile_base[tiles][:, None] + torch.cumsum(counts, dim=1) - counts


def pack_lanes(
    symbols: torch.Tensor,
    enc_table: torch.Tensor,
    lane_words: torch.Tensor,
    tile_base: torch.Tensor,
    stream: torch.Tensor,
    steps: int,
    lanes: int,
    elems: int = 1,
) -> None:
    """Pass 2: write the lanes' bits into ``stream`` (``int32``, at least ``tile_base[-1] + 2`` words).

    Codes never overlap, so each code's one or two word pieces are summed into place.
    """
    codes, lengths = _codes_and_lengths(symbols, enc_table, steps, lanes, elems)
    tiles = torch.arange(codes.shape[0], device=symbols.device)
    start_bit = lane_starts(lane_words, tile_base, tiles, lanes)[:, None, :] * 32
    bit = start_bit + torch.cumsum(lengths, dim=1) - lengths
    word, end = bit >> 5, (bit & 31) + lengths
    first = torch.where(end <= 32, codes << (32 - end).clamp(min=0), codes >> (end - 32).clamp(min=0))
    second = torch.where(end > 32, (codes << (64 - end).clamp(max=63)) & 0xFFFFFFFF, 0)
    used = int(tile_base[-1]) + STREAM_PAD_WORDS
    words = torch.zeros(used, dtype=torch.int64, device=symbols.device)
    words.index_add_(0, word.reshape(-1), first.reshape(-1))
    words.index_add_(0, (word + 1).reshape(-1), second.reshape(-1))
    signed = torch.where(words >= (1 << 31), words - (1 << 32), words)
    stream[:used].copy_(signed.to(torch.int32))


def _take(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``source[index]`` through ``index_select``: on CPU ~80x faster than advanced
    indexing with a 2D index, and this runs once per symbol step."""
    return source.index_select(0, index.reshape(-1)).view(index.shape)


def decode_tiles(
    stream: torch.Tensor,
    lane_words: torch.Tensor,
    tile_base: torch.Tensor,
    lut: torch.Tensor,
    numel: int,
    steps: int,
    lanes: int,
    tiles: torch.Tensor | None = None,
    elems: int = 1,
) -> torch.Tensor:
    """Decode the symbols of ``tiles`` (default: all) as ``int64[len(tiles) * S * L * E]``, in element order.

    Positions past ``numel`` hold 0. One Python step decodes one symbol of every
    lane at once, so the cost is ``S`` vectorised steps, not one per element.
    """
    device = stream.device
    if tiles is None:
        tiles = torch.arange(num_tiles(numel, steps, lanes, elems), device=device)
    tiles = tiles.to(device=device, dtype=torch.int64)
    words = stream.to(torch.int64) & 0xFFFFFFFF
    lut64 = lut.to(torch.int64)
    bit = lane_starts(lane_words, tile_base, tiles, lanes) * 32
    first_index = tiles[:, None] * (steps * lanes * elems) + torch.arange(lanes, device=device) * elems
    out = torch.zeros(tiles.numel(), steps * elems, lanes, dtype=torch.int64, device=device)
    for step in range(steps * elems):
        # Coding order (s, e) -> element s * L * E + l * E + e of the tile.
        valid = (first_index + (step // elems) * lanes * elems + step % elems) < numel
        offset = bit & 31
        w0, w1 = _take(words, bit >> 5), _take(words, (bit >> 5) + 1)
        window = ((w0 << offset) | (w1 >> (32 - offset))) & 0xFFFFFFFF  # next 32 stream bits
        entry = _take(lut64, window >> (32 - MAX_CODE_BITS))
        symbol, length = entry & 0x1FF, entry >> 9
        escaped = symbol == ESCAPE
        literal = (window >> (32 - LITERAL_BITS - length)) & ((1 << LITERAL_BITS) - 1)
        symbol = torch.where(escaped, literal, symbol)
        length = length + LITERAL_BITS * escaped
        out[:, step, :] = torch.where(valid, symbol, 0)
        bit = bit + torch.where(valid, length, 0)
    return out.view(tiles.numel(), steps, elems, lanes).transpose(2, 3).reshape(-1)
