"""A compressed vocabulary matrix updated row block by row block: it is never decoded whole.

The streamed update of the embedding and the lm_head (:mod:`neutrain.optim.streamed`)
walks the weight's rows in order, one optimizer chunk at a time. Reading the weight
whole for it put the dense matrix (1 GiB for Llama-3-8B's 128,256 x 4096) in the
large decode slot at the step's peak. :class:`RowBlocks` gives the optimizer the rows
instead: the first access to a block decodes it (a few hundred tiles) into a block
buffer, the optimizer updates those rows in place, and moving on to the next block
re-encodes the finished one (:mod:`neutrain.compress.blocks`: tails in place, codes
into a second exponent stream swapped in at the end). A block is a whole number of
optimizer chunks *and* of codec tiles, so chunking, noise offsets and every
updated value are those of the whole-weight update, bit for bit.

The chunked loss (:mod:`neutrain.nn.linear_cross_entropy`) reads the lm_head through
:func:`rows_for_compute` the same way: a :class:`RowReader` decodes the tile-aligned block
holding the vocabulary chunk it asks for. Forward and both backward passes walk the
chunks in order, so each decodes every tile once (the same tiles a whole decode
runs), and the matrix never sits whole in the large decode slot. Where the compute
dtype is the stored one (bf16 on a GPU), the update's blocks are the reader's: the
loss's last pass and the update decode each block once, into one buffer. That is
safe because the gradient of a block's rows is recomputed before any of them changes
(see ``_streamed_weight_update``), and a block is re-encoded only once the update
has moved past it.
"""

from __future__ import annotations

import math

import torch

from neutrain.compress.blocks import BlockRecode, aligned_rows, block_recode, decode_tiles, tile_numel
from neutrain.nn.buffers import DECODE_BUFFERS

MAX_BLOCK_FRACTION = 0.5
"""Blocks larger than this share of the weight (tile alignment can demand many rows) save too little:
the update then reads the weight whole, as before."""
ON_CUDA = False
"""Whether CUDA weights take the block path (off: CPU only). On an H100 (commit 37ed85a,
``tests/unit/nn/test_row_blocks_gpu.py`` and ``benchmarks/memory/row_blocks_gpu_diag.py``) the first
block re-encode of the lm_head published 3.1 % more coded exponent bits than the weight holds
(22,515,284 against 21,831,076 at lr 1e-4), which forced a code rebuild at the next step; later steps
were normal (+0.02 %). Values other than the updated weight's were encoded in that first step, and
the cause is not found: until a GPU run shows the blocked step bit-identical to dense, CUDA weights are
read and re-encoded whole, as before row blocks existed. The CPU paths are tested bit-identical."""
MIN_GPU_BLOCK_TILES = 1024
"""On a GPU a block is grown (up to :data:`MAX_BLOCK_FRACTION`) to at least this many tiles: one
program per tile, and an H100 holds ~1,056 resident at 256 threads, so smaller launches leave it idle
(Llama-3's lm_head: 8,192 rows of 4,096, a 64 MiB block)."""


def _locate(rows: slice, num_rows: int, block_rows: int) -> tuple[int, int, int, int]:
    """(start, stop, block index, block's first row) of a row slice that must lie inside one block."""
    start, stop = rows.start or 0, min(num_rows, num_rows if rows.stop is None else rows.stop)
    index = start // block_rows
    first_row = index * block_rows
    if stop > first_row + block_rows or rows.step not in (None, 1):
        raise ValueError(f"rows {start}:{stop} are not inside one block of {block_rows} rows")
    return start, stop, index, first_row


def _block_rows(weight, chunk_rows: int) -> int | None:
    """Rows of a tile-aligned block of whole chunks, or None where blocks would not pay (or cannot be)."""
    if weight.home is not None or len(weight.shape) != 2 or weight.shape[0] == 0:
        return None
    if weight.device.type == "cuda" and not ON_CUDA:
        return None
    rows = aligned_rows(weight.ct, chunk_rows)
    limit = int(MAX_BLOCK_FRACTION * weight.shape[0])
    if rows > limit:
        return None
    if weight.device.type == "cuda":
        tiles = rows * math.prod(weight.shape[1:]) // tile_numel(weight.ct)
        rows *= max(1, min(-(-MIN_GPU_BLOCK_TILES // tiles), limit // rows))
    return rows


def rows_for_compute(weight, chunk_rows: int):
    """The 2-D compressed ``weight`` for reading chunks of ``chunk_rows`` rows in :attr:`compute_dtype`:
    a :class:`RowReader`, or the whole decoded weight where blocks would not pay. Both slice by rows.

    Example:
        >>> from neutrain.compress import compress
        >>> from neutrain.nn.weight import CompressedWeight
        >>> w = torch.randn(64, 1024).bfloat16()
        >>> reader = rows_for_compute(CompressedWeight(compress(w, steps=8, lanes=16)), 4)
        >>> type(reader).__name__, torch.equal(reader[8:12], w[8:12])
        ('RowReader', True)
    """
    rows = _block_rows(weight, chunk_rows)
    if rows is None:
        return weight.decode_for_compute()
    DECODE_BUFFERS.release_large(weight)  # an idle (unpinned) large slot would hold the matrix's size
    weight.reader = RowReader(weight, rows)  # the streamed update may share its buffer (row_blocks)
    return weight.reader


class RowReader:
    """Rows of a compressed 2-D weight in its compute dtype, decoded a tile-aligned block at a time.

    ``reader[start:stop]`` (inside one block of ``block_rows`` rows) decodes that block unless it is
    the one held; ``shape``, ``dtype`` (the compute dtype) and ``device`` are the weight's.
    """

    def __init__(self, weight, block_rows: int):
        self.weight, self.block_rows = weight, block_rows
        self.shape = torch.Size(weight.shape)
        self.dtype, self.device = weight.compute_dtype, weight.device
        self._row_numel = self.shape[1]
        self._tile_len = tile_numel(weight.ct)
        self._buffer = torch.empty(block_rows * self._row_numel, dtype=weight.dtype, device=weight.device)
        self._block = None  # (index, version, rows in the compute dtype)
        self.updating = None  # the RowBlocks sharing the buffer during a streamed update

    def __getitem__(self, rows: slice) -> torch.Tensor:
        start, stop, index, first_row = _locate(rows, self.shape[0], self.block_rows)
        weight = self.weight
        if self._block is None or self._block[:2] != (index, weight.version):
            first_tile = first_row * self._row_numel // self._tile_len
            stop_tile = min(weight.ct.tiles, first_tile + self._buffer.numel() // self._tile_len)
            if self.updating is not None:
                # The buffer holds the block being updated: it is re-encoded before this one is decoded.
                self.updating._open(index)  # adopts the block into this reader
            else:
                weight._resident()
                dense = decode_tiles(weight.ct, first_tile, stop_tile, self._buffer).view(-1, self._row_numel)
                self.adopt(index, dense)
        return self._block[2][start - first_row : stop - first_row]

    @property
    def shares_storage(self) -> bool:
        """Whether the rows it returns are its block buffer itself (compute dtype = stored dtype)."""
        return self.dtype == self.weight.dtype

    def held(self, index: int) -> torch.Tensor | None:
        """Block ``index`` of the current version, as stored rows in the buffer, if held."""
        block = self._block
        if block is not None and block[:2] == (index, self.weight.version) and self.shares_storage:
            return block[2]
        return None

    def adopt(self, index: int, dense: torch.Tensor) -> None:
        """Hold ``dense`` (stored rows of block ``index``, decoded into the buffer) as that block."""
        self._block = (index, self.weight.version, dense if dense.dtype == self.dtype else dense.to(self.dtype))


def row_blocks(weight, chunk_rows: int) -> "RowBlocks | None":
    """Row-block access to the 2-D compressed ``weight`` for an update by chunks of ``chunk_rows`` rows,
    or None where the update must read it whole (offloaded, lossy, a code rebuild due, blocks too large).

    Example:
        >>> from neutrain.compress import compress
        >>> from neutrain.nn.weight import CompressedWeight
        >>> w = torch.randn(64, 1024).bfloat16()
        >>> cw = CompressedWeight(compress(w, steps=8, lanes=16))  # 512-element tiles
        >>> blocks = row_blocks(cw, 4)
        >>> for start in range(0, 64, 4):
        ...     _ = blocks[start : start + 4].add_(1.0)  # an optimizer's in-place update of 4 rows
        >>> cw.write_blocks_(blocks)
        >>> torch.equal(cw.decode(), w + 1.0)
        True
    """
    reader = getattr(weight, "reader", None)
    if reader is not None and not (reader.shares_storage and reader.block_rows % chunk_rows == 0):
        reader = None
    rows = reader.block_rows if reader is not None else _block_rows(weight, chunk_rows)
    recode = None if rows is None else block_recode(weight.ct)
    return None if recode is None else RowBlocks(weight, recode, rows, reader)


class RowBlocks:
    """The rows of one compressed 2-D weight, decoded and re-encoded a block at a time, blocks in order.

    ``blocks[rows]`` (a slice inside one block) returns those rows of the block buffer, for
    an in-place update; :meth:`close` re-encodes the last block (and any never visited)
    and swaps the new encoding in. Quacks enough like the rows of a weight tensor for the
    optimizer's row-chunk driver (``shape``, ``dtype``, ``device``, ``is_cuda``).
    """

    def __init__(self, weight, recode: BlockRecode, block_rows: int, reader: RowReader | None = None):
        ct = weight.ct
        self.weight, self.recode, self.block_rows, self.reader = weight, recode, block_rows, reader
        self.shape = torch.Size(ct.shape)
        self.dtype, self.device = ct.dtype, ct.device
        self.is_cuda = self.device.type == "cuda"
        self._row_numel = math.prod(ct.shape[1:])
        self._tile_len = tile_numel(ct)
        if reader is not None:  # the chunked loss's reader: its block is the one being updated
            self._buffer = reader._buffer
            reader.updating = self
        else:
            self._buffer = torch.empty(block_rows * self._row_numel, dtype=ct.dtype, device=ct.device)
        self._block = None  # (index, rows view) of the block in the buffer
        self._next = 0  # first block not yet decoded

    @property
    def blocks(self) -> int:
        return -(-self.shape[0] // self.block_rows)

    @property
    def buffer_nbytes(self) -> int:
        return self._buffer.numel() * self._buffer.element_size()

    def __getitem__(self, rows: slice) -> torch.Tensor:
        start, stop, index, first_row = _locate(rows, self.shape[0], self.block_rows)
        if self._block is None or self._block[0] != index:
            self._open(index)
        return self._block[1][start - first_row : stop - first_row]

    def _open(self, index: int) -> None:
        if index < self._next:
            raise ValueError(f"block {index} was re-encoded already: blocks are updated in order")
        self._flush()
        while self._next < index:  # blocks the update skipped keep their values
            self._decode(self._next)
            self._flush()
        self._decode(index)

    def _decode(self, index: int) -> None:
        first_tile = index * self.block_rows * self._row_numel // self._tile_len
        stop_tile = min(self.recode.ct.tiles, first_tile + self._buffer.numel() // self._tile_len)
        dense = self.reader.held(index) if self.reader is not None else None
        if dense is None:
            dense = self.recode.decode(first_tile, stop_tile, self._buffer).view(-1, self._row_numel)
            if self.reader is not None:
                self.reader.adopt(index, dense)  # the loss recomputes this block's gradient from these rows
        self._block = (index, dense)
        self._next = index + 1

    def _flush(self) -> None:
        if self._block is not None:
            index, dense = self._block
            self.recode.encode(index * self.block_rows * self._row_numel // self._tile_len, dense)
            self._block = None

    def close(self) -> None:
        """Re-encode the open block and any not visited; swap the new encoding in."""
        self._flush()
        while self._next < self.blocks:
            self._decode(self._next)
            self._flush()
        self.recode.finish()
        self._buffer = None
        if self.reader is not None:
            self.reader.updating = None
