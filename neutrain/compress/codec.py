"""Reference (pure PyTorch) lane-interleaved Huffman codec: the specification.

Layout ("LIH", docs/codec.md §6 and §8). The flat tensor is cut into tiles of
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
lanes of the requested tiles in lock-step, one vectorised step at a time: the
readable specification. :func:`decode_tiles_jumping` computes the same symbols
with no loop over steps (pointer jumping), which is what the CPU path runs.
"""

from __future__ import annotations

import torch

from neutrain.compress.huffman import ESCAPE, LITERAL_BITS, MAX_CODE_BITS, MAX_SYMBOL_BITS

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
    bit = torch.cumsum(lengths, dim=1).sub_(lengths).add_(start_bit)
    word = bit >> 5
    # The code left-aligned in the 64 bits of words (word, word + 1): its end is at most 31 + 21 bits in.
    placed = codes.bitwise_left_shift_(bit.bitwise_and_(31).add_(lengths).neg_().add_(64))
    first = (placed >> 32).bitwise_and_(0xFFFFFFFF)
    second = placed.bitwise_and_(0xFFFFFFFF)
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



JUMP_CHUNK_BITS = 1 << 24
"""Stream bits decoded per chunk by :func:`decode_tiles_jumping` (bounds its int32 tables to 64 MiB each)."""
# Cost model (2-core x86 CPU) for how many pointer-jumping rounds pay off: a round is one gather
# over every stream bit; each round halves the sequential walk, a step of which is one gather of
# one position per lane plus a fixed dispatch cost.
_NS_PER_BIT_GATHER = 2.5
_NS_PER_STEP = 5000.0
_NS_PER_LANE_STEP = 2.0
_ARANGE = torch.empty(0, dtype=torch.int32)
jumping_decodes = 0
"""Calls of :func:`decode_tiles_jumping` (tests check that the CPU path runs it)."""


def _bit_index(nbits: int, device: torch.device) -> torch.Tensor:
    """``arange(nbits)`` as int32, cached on the CPU (it is added to every bit of every decode)."""
    global _ARANGE
    if device.type != "cpu":
        return torch.arange(nbits, dtype=torch.int32, device=device)
    if _ARANGE.numel() < nbits:
        _ARANGE = torch.arange(max(nbits, 2 * _ARANGE.numel()), dtype=torch.int32)
    return _ARANGE[:nbits]


def _code_tables(lut: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(symbol per 12-bit window, coded length per window escapes included, escape code length)."""
    lut32 = lut.to(torch.int32)
    symbol, length = lut32 & 0x1FF, lut32 >> 9
    escaped = symbol == ESCAPE
    escape_lengths = length[escaped]
    escape_len = int(escape_lengths[0]) if escape_lengths.numel() else 0
    return symbol, length + LITERAL_BITS * escaped.to(torch.int32), escape_len


def _jump_rounds(nbits: int, lanes: int, count: int) -> int:
    """Pointer-jumping rounds worth their cost for ``lanes`` lanes of ``count`` codes in ``nbits`` bits."""
    rounds = 0
    while (1 << (rounds + 1)) <= count:
        saved_steps = count // (1 << (rounds + 1))
        if nbits * _NS_PER_BIT_GATHER >= saved_steps * (_NS_PER_STEP + lanes * _NS_PER_LANE_STEP):
            break
        rounds += 1
    return rounds


def _lane_symbols_jumping(words: torch.Tensor, lane_bits: torch.Tensor, count: int,
                          symbol_of: torch.Tensor, length_of: torch.Tensor, escape_len: int) -> torch.Tensor:
    """The first ``count`` symbols of lanes starting at ``lane_bits`` of a word stream: ``int32[count, lanes]``.

    ``jump[0][b]`` is the bit where the code after one starting at bit ``b`` starts (``b`` plus the
    code length that the 12-bit window at ``b`` gives); squaring (``jump[k][jump[k]]``) makes
    ``jump[k]`` skip ``2**k`` codes. The lanes walk with the widest table, one gather per stride,
    then the positions in between follow by doubling down the narrower tables, and one gather
    reads every symbol. Bits that are not code starts get meaningless entries no lane reaches.
    """
    device = words.device
    wide = words.to(torch.int64) & 0xFFFFFFFF
    pair = (wide[:-1] << 32) | wide[1:]  # bits of words w and w + 1
    shifts = torch.arange(52, 20, -1, device=device)  # the 12-bit window at each of the word's 32 bits
    window = (pair[:, None] >> shifts).to(torch.int32).reshape(-1).bitwise_and_(0xFFF)
    nbits, lanes = window.numel(), lane_bits.numel()
    jump = length_of.index_select(0, window).add_(_bit_index(nbits, device))
    jump[-MAX_SYMBOL_BITS:].clamp_(max=nbits - 1)  # only the last codes can point past the end
    jumps = [jump]
    for _ in range(_jump_rounds(nbits, lanes, count)):
        jumps.append(jumps[-1].index_select(0, jumps[-1]))
    stride = 1 << (len(jumps) - 1)
    positions = torch.empty(-(-count // stride) * stride, lanes, dtype=torch.int32, device=device)
    positions[0] = lane_bits
    rows = positions.unbind(0)  # views, made once: the walk below is the per-step Python cost
    for row in range(stride, positions.shape[0], stride):  # the sequential walk, one stride at a time
        torch.index_select(jumps[-1], 0, rows[row - stride], out=rows[row])
    for level in range(len(jumps) - 2, -1, -1):  # fill in between: rows 2**level apart
        step = 1 << level
        known = positions[:: 2 * step]
        positions[step :: 2 * step] = jumps[level].index_select(0, known.reshape(-1)).view(known.shape)
    positions = positions[:count]
    symbols = symbol_of.index_select(0, window.index_select(0, positions.reshape(-1))).view(positions.shape)
    escaped = (symbols == ESCAPE).nonzero(as_tuple=True)
    if escaped[0].numel():  # a literal follows the escape code: the top 9 bits of the window there
        literal_at = (positions[escaped] + escape_len).clamp(max=nbits - 1)
        symbols[escaped] = window.index_select(0, literal_at) >> (MAX_CODE_BITS - LITERAL_BITS)
    return symbols


def decode_tiles_jumping(
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
    """:func:`decode_tiles` without a Python loop over symbol steps: the same symbols, as ``int32``.

    A lookup of the code length at every bit of the stream turns the lanes' sequential
    parse into gathers (see :func:`_lane_symbols_jumping`): a handful of whole-stream passes
    plus one small gather per step, or fewer steps after pointer-jumping rounds where those
    pay off. Chunks of whole tiles (up to :data:`JUMP_CHUNK_BITS` bits) are copied into a
    compact local stream, so a tile subset (embedding rows) costs only its own bits.

    Example:
        >>> from neutrain.compress import compress
        >>> ct = compress(torch.randn(3000).bfloat16(), backend="reference")
        >>> args = (ct.stream, ct.lane_words, ct.tile_base, ct.lut, ct.numel, ct.steps, ct.lanes)
        >>> torch.equal(decode_tiles_jumping(*args, elems=ct.elems).long(), decode_tiles(*args, elems=ct.elems))
        True
    """
    global jumping_decodes
    jumping_decodes += 1
    device = stream.device
    full = tiles is None
    if full:
        tiles = torch.arange(num_tiles(numel, steps, lanes, elems), device=device)
    tiles = tiles.to(device=device, dtype=torch.int64).reshape(-1)
    count, tile_len = steps * elems, steps * lanes * elems
    out = torch.empty(tiles.numel(), steps, lanes, elems, dtype=torch.int32, device=device)
    if tiles.numel() == 0:
        return out.reshape(-1)
    symbol_of, length_of, escape_len = _code_tables(lut.to(device))
    lane_counts = lane_words.view(-1, lanes).index_select(0, tiles).to(torch.int64)
    tile_words = lane_counts.sum(dim=1)
    ends = torch.cumsum(tile_words, dim=0).tolist()
    bounds, first = [], 0  # chunks of consecutive list entries, up to JUMP_CHUNK_BITS bits (at least one tile)
    for i, end in enumerate(ends):
        if i == len(ends) - 1 or (ends[i + 1] - (ends[first - 1] if first else 0)) * 32 > JUMP_CHUNK_BITS:
            bounds.append((first, i + 1))
            first = i + 1
    pad = torch.zeros(STREAM_PAD_WORDS, dtype=stream.dtype, device=device)
    for lo, hi in bounds:
        chunk_tiles, chunk_words = tiles[lo:hi], tile_words[lo:hi]
        local_base = torch.cumsum(chunk_words, dim=0) - chunk_words
        if full:  # consecutive tiles: their words are one slice, and the stream is padded already
            begin = int(tile_base[chunk_tiles[0]])
            words = stream[begin : begin + int(chunk_words.sum()) + STREAM_PAD_WORDS]
        else:  # the chunk's words, tile after tile, then zero padding (a window may read past the last code)
            word_index = (torch.repeat_interleave(tile_base[chunk_tiles] - local_base, chunk_words)
                          + torch.arange(int(chunk_words.sum()), device=device))
            words = torch.cat([stream.index_select(0, word_index), pad])
        counts = lane_counts[lo:hi]
        lane_bits = (local_base[:, None] + torch.cumsum(counts, dim=1) - counts) * 32
        symbols = _lane_symbols_jumping(words, lane_bits.reshape(-1), count, symbol_of, length_of, escape_len)
        # Coding order (s, e) of lane l -> element s * L * E + l * E + e of the tile.
        out[lo:hi] = symbols.view(steps, elems, hi - lo, lanes).permute(2, 0, 3, 1)
    out = out.view(-1, tile_len)
    last = num_tiles(numel, steps, lanes, elems) - 1
    partial = (tiles == last).nonzero(as_tuple=True)[0]
    if partial.numel() and numel % tile_len:  # elements past numel were not coded
        out[partial, numel % tile_len :] = 0
    return out.reshape(-1)
