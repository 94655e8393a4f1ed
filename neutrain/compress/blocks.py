"""Re-encode a compressed tensor tile block by tile block, so it is never decoded whole.

A vocabulary matrix (Llama-3's lm_head and embedding: 128,256 x 4096, 1 GiB in
bf16) updated row block by row block needs only one block dense at a time if
each block, once updated, is encoded straight back. :class:`BlockRecode` does that:

* ``decode(first, stop, out)`` decodes tiles ``[first, stop)`` of the *current*
  encoding; ``encode(first, x)`` encodes the updated block ``x`` (those tiles),
  blocks in order from tile 0, each block decoded before it is encoded.
* The sign+mantissa tails and lane word counts are per element / per lane, so they
  are written in place. The exponent stream is not (a block's new codes may be
  longer or shorter), so blocks go, tile-aligned and back to back, into a second
  stream with its own tile table; the old stream and table still serve the blocks
  not yet updated. ``finish()`` swaps the new ones in: one stream-sized buffer
  (~180 MB for the 8B lm_head, 2.7 bits/weight) instead of the 1 GiB dense matrix.
* The code table stays the current one: every symbol has a code or an escape
  (:mod:`neutrain.compress.huffman`), so any values encode exactly, lossless
  whatever the table. The whole-tensor histogram of the new values is known only
  at the end, so a re-encode due for a new table (the exponent stream grew
  :data:`~neutrain.compress.stream.REBUILD_GROWTH` past its size at build) is not
  done by blocks: :func:`block_recode` returns None and the caller encodes whole,
  which rebuilds the table, as before.
* Encoding all blocks writes the same bytes as one whole-tensor encode with the
  same table (the tests compare them).

On the GPU (lossless bf16, Triton) nothing is read back to the host: the fit of
the new stream is checked on the device and published like a sync-free
``recompress_`` (:mod:`neutrain.compress.stream`). The second stream gets at least
1/32 above the last encode's length (the most headroom a whole encode earns), because unlike a whole encode, an overflowing block re-encode
cannot keep the old value (its tails are already rewritten): the tensor is
flagged lost and the next look at its status raises ``StreamOverflowError``.
Elsewhere (reference and CPU codecs) each block is encoded as a tensor of its own
and spliced in, with host reads.
"""

from __future__ import annotations

import math

import torch

from neutrain.compress import codec, codec_cpu
from neutrain.compress import stream as kstream
from neutrain.compress.layout import from_bits, merge, merge_bf16_bytes, splits_bytewise, unpack_tails

def tile_numel(ct) -> int:
    """Elements per tile of ``ct`` (blocks must start at a multiple of it)."""
    return ct.steps * ct.lanes * ct.elems


def decode_tiles(ct, first: int, stop: int, out: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Decode tiles ``[first, stop)`` of ``ct`` into ``out`` (contiguous, at least ``(stop - first)`` tiles of
    elements); returns ``out``'s first ``min(stop * tile, numel) - first * tile`` elements, flat.

    Example:
        >>> from neutrain.compress import compress
        >>> w = torch.randn(64, 128).bfloat16()
        >>> ct = compress(w, steps=8, lanes=16)  # 512-element tiles: 4 rows each
        >>> rows = decode_tiles(ct, 2, 4, torch.empty(1024, dtype=torch.bfloat16)).view(-1, 128)
        >>> torch.equal(rows, w[8:16])
        True
    """
    from neutrain.compress.tensor import _use_kernel  # lazy: tensor imports this module

    tile_len = tile_numel(ct)
    start, end = first * tile_len, min(stop * tile_len, ct.numel)
    out = out.view(-1)
    tiles = torch.arange(first, stop, device=ct.device)
    if _use_kernel(ct.layout, ct.elems, ct.device, backend):
        from neutrain.kernels import codec as kcodec  # lazy: Triton, GPU path only

        kcodec.decode(ct.stream, ct.lane_words, ct.tile_base, ct.tails, ct.lut, out, ct.numel, ct.steps,
                      ct.lanes, ct.layout.kept, ct.elems, tile_ids=tiles)
        return out[: end - start]
    if codec_cpu.enabled(ct.device, backend):
        symbols = codec_cpu.decode_symbols(ct, tiles)
    else:
        symbols = codec.decode_tiles_jumping(ct.stream, ct.lane_words, ct.tile_base, ct.lut, ct.numel, ct.steps,
                                             ct.lanes, tiles=tiles, elems=ct.elems)
    symbols = symbols[: end - start]
    dense = out[: end - start]
    if splits_bytewise(ct.layout, ct.device):
        return merge_bf16_bytes(symbols, ct._tails_view()[start:end], dense)
    tails = unpack_tails(ct._tails_view(), ct.layout.tail_bits, torch.arange(start, end, device=ct.device))
    dense.copy_(from_bits(merge(symbols.long(), tails, ct.layout), ct.dtype))
    return dense


def block_recode(ct, backend: str = "auto") -> "BlockRecode | None":
    """A :class:`BlockRecode` of ``ct``, or None where only a whole encode will do.

    None for lossy tensors (their tails pack across lanes) and when the code table is
    due for a rebuild (see the module docstring).

    Example:
        >>> from neutrain.compress import compress
        >>> w = torch.randn(64, 128).bfloat16()
        >>> ct = compress(w, steps=8, lanes=16)  # 512-element tiles: 4 rows each
        >>> new = w + 1
        >>> recode = block_recode(ct)
        >>> for first in range(0, ct.tiles, 4):  # 16 rows a block
        ...     old = recode.decode(first, first + 4, torch.empty(4 * 512, dtype=torch.bfloat16))
        ...     recode.encode(first, new.view(-1)[first * 512 : (first + 4) * 512])
        >>> recode.finish()
        >>> torch.equal(ct.decompress(), new)
        True
    """
    if not ct.layout.lossless or ct.tiles == 0:
        return None
    from neutrain.compress.tensor import _use_kernel  # lazy: tensor imports this module

    kernel = _use_kernel(ct.layout, ct.elems, ct.device, backend)
    if kernel:
        if not kstream.prepare_sync_free(ct):
            return None
    else:
        kstream.settle(ct, wait=True)
        if ct._coded_seen > (1 + kstream.REBUILD_GROWTH) * ct._coded_bits_at_build:
            return None
    return BlockRecode(ct, kernel, backend)


class BlockRecode:
    """One block-by-block re-encode of a compressed tensor (build it with :func:`block_recode`)."""

    def __init__(self, ct, kernel: bool, backend: str):
        self.ct, self.kernel, self.backend = ct, kernel, backend
        # At least 1/32 above the last encode's length, whatever headroom the tensor earned so far
        # (kstream.capacity_for starts small): an overflow here loses the value, so it must
        # take a step that grows the exponent stream by over 3 % (the margin every tensor had before).
        # Costs ~0.085 bit per weight on the (two) vocabulary matrices while training; none on disk.
        capacity = max(ct.stream.numel(), kstream.capacity_for(ct._words, kstream.MIN_HEADROOM_SHIFT))
        self.stream = torch.zeros(capacity, dtype=torch.int32, device=ct.device)
        self.tile_base = torch.zeros_like(ct.tile_base)
        self.next_tile = 0
        self.words = 0  # host paths: new stream words so far (no padding)
        self.coded = 0
        if kernel:
            self.scratch = kstream.kernel_scratch(ct)
            self.status = torch.zeros(3, dtype=torch.int64, device=ct.device)  # tile 0's writes land here

    # ---------------------------------------------------------------- decoding
    def decode(self, first: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        """:func:`decode_tiles` of a block not yet re-encoded."""
        if first < self.next_tile:
            raise ValueError(f"tiles [{first}, {stop}) were re-encoded already (next: {self.next_tile})")
        return decode_tiles(self.ct, first, stop, out, self.backend)

    # ---------------------------------------------------------------- encoding
    def encode(self, first: int, x: torch.Tensor) -> None:
        """Encode ``x`` (the new values of the elements from tile ``first`` on: whole tiles, or up to the
        tensor's end) as those tiles. Blocks come in order: ``first`` is the tile after the last block."""
        ct = self.ct
        tile_len = tile_numel(ct)
        if first != self.next_tile:
            raise ValueError(f"blocks re-encode in order: expected tile {self.next_tile}, got {first}")
        start = first * tile_len
        x = x.detach().reshape(-1)
        end = start + x.numel()
        if x.dtype != ct.dtype or x.device != ct.device or (end != ct.numel and x.numel() % tile_len) \
                or end > ct.numel:
            raise ValueError(f"a block is whole tiles of {tile_len} elements ({ct.dtype} on {ct.device}), or runs "
                             f"to the end; got {x.numel()} {x.dtype} elements at tile {first}")
        stop = first + -(-x.numel() // tile_len)
        x = x.contiguous()
        if self.kernel:
            self._encode_kernel(first, stop, x)
        else:
            self._encode_spliced(first, stop, x)
        self.next_tile = stop

    def _encode_kernel(self, first: int, stop: int, x: torch.Tensor) -> None:
        from neutrain.kernels import codec_blocks  # lazy: Triton, GPU path only

        ct = self.ct
        counts, scratch, cum = self.scratch
        codec_blocks.count_block(x, first, ct.enc_table, counts, scratch, ct.steps, ct.lanes, ct.elems)
        # Inclusive prefix sums over all tiles so far: each tile's offset in the whole new stream.
        block = torch.cumsum(scratch[:, first:stop], dim=1)
        if first:
            block += cum[:, first - 1 : first]
        cum[:, first:stop] = block
        codec_blocks.pack_block(x, first, ct.enc_table, counts, cum, self.stream.numel(), self.stream, ct.tails,
                                ct.lane_words, self.tile_base, self.status, ct.steps, ct.lanes, ct.elems)

    def _encode_spliced(self, first: int, stop: int, x: torch.Tensor) -> None:
        """Host paths: the block encoded as a tensor of its own (same code and geometry), copied in."""
        from neutrain.compress.tensor import CompressedTensor  # lazy: tensor imports this module

        ct = self.ct
        part = CompressedTensor(ct.layout, (x.numel(),), ct.device, ct.steps, ct.lanes, ct.elems, ct.code_lengths)
        part._encode(x, self.backend, fresh_code=True)  # "fresh": keep this code, never rebuild it
        used = part._words - codec.STREAM_PAD_WORDS
        if self.words + part._words > self.stream.numel():
            grown = torch.zeros(kstream.capacity_for(self.words + part._words), dtype=torch.int32, device=ct.device)
            grown[: self.words].copy_(self.stream[: self.words])
            self.stream = grown
        self.stream[self.words : self.words + used].copy_(part.stream[:used])
        self.tile_base[first + 1 : stop + 1] = part.tile_base[1:] + self.words
        ct.lane_words[first * ct.lanes : stop * ct.lanes].copy_(part.lane_words)
        tail_start = first * tile_numel(ct) * ct.layout.tail_bits // 8
        ct.tails[tail_start : tail_start + part._tails_used].copy_(part._tails_view())
        self.words += used
        self.coded += part._coded_seen

    def finish(self) -> None:
        """Swap in the new stream and tile table (after the last block; tiles not re-encoded are an error)."""
        ct = self.ct
        if self.next_tile != ct.tiles:
            raise ValueError(f"{ct.tiles - self.next_tile} tiles of {ct.name or 'the tensor'} were not re-encoded")
        if self.kernel:
            _, _, cum = self.scratch
            words = cum[0, -1] + codec.STREAM_PAD_WORDS
            lost = (words > self.stream.numel()).to(torch.int64) * kstream.OVERFLOW_LOST
            lost = torch.maximum(lost, ct.status.tensor[2])  # a flag not yet seen stays raised
            ct.status.tensor.copy_(torch.stack([words, cum[1, -1], lost]))
            ct.status.publish()  # seen by the next encode (kstream.settle), never waited for here
        else:
            ct._words, ct._coded_seen = self.words + codec.STREAM_PAD_WORDS, self.coded
        ct.stream, ct.tile_base = self.stream, self.tile_base
        self.stream = self.tile_base = None


def aligned_rows(ct, rows: int) -> int:
    """The smallest multiple of ``rows`` whose elements are whole tiles of ``ct`` (rows of ``shape[1:]``).

    Example:
        >>> from neutrain.compress import compress
        >>> aligned_rows(compress(torch.zeros(64, 128).bfloat16(), steps=8, lanes=16), 1)  # 512-element tiles
        4
    """
    row_numel = math.prod(ct.shape[1:])
    tile_len = tile_numel(ct)
    return rows * (tile_len // math.gcd(rows * row_numel, tile_len))
