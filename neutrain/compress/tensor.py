"""``CompressedTensor``: a weight kept NeuZip-compressed, and :func:`compress`.

Everything the hot path needs (code tables, tile tables, buffers) is built at
encode time, so ``decompress(out=buf)`` on a GPU is one kernel launch: no
allocation and no host synchronisation. ``recompress_`` reuses every buffer
whose size is fixed by the shape (tails, lane counts, tile table) and the
stream while it fits. With ``sync=False`` (what training calls) it reads nothing
back to the host: the stream keeps headroom and the kernels commit only what fits
(:mod:`neutrain.compress.stream`); with ``sync=True`` it reads the new length
between its two passes and grows the stream first.

Backends: ``"triton"`` (kernels in :mod:`neutrain.kernels.codec`; bf16 only),
``"reference"`` (pure PyTorch, any device and dtype) and ``"auto"`` (Triton for
bf16 on CUDA, else the reference). Both write the same bytes.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from neutrain.compress import codec, codec_cpu, format as fmt, huffman, stream as kstream
from neutrain.compress.layout import Layout, from_bits, layout_for, merge, pack_tails, split, tail_nbytes, to_bits
from neutrain.compress.layout import merge_bf16_bytes, split_bf16_bytes, splits_bytewise, tails_capacity
from neutrain.compress.layout import unpack_tails
from neutrain.kernels import triton_available

DEFAULT_STEPS = 32
"""Steps per lane. With 4 elements per step a lane codes 128 symbols: lane padding and
word counts cost ~0.19 bit/weight (0.09 at 64 steps), but twice as many lanes decode
side by side, and the per-lane decode chain is what bounds the speed (on an H100,
4096x14336: 561 against 510 GB/s; 1024x4096: 180 against 88; benchmarks/codec/NOTES.md)."""
SMALL_STEPS = 16
"""Steps per lane below :data:`SMALL_NUMEL` weights: such a tensor has too few lanes to fill
the GPU at 32 steps, so each lane's serial chain shows (H100, 1024x4096: decode 377 against
197 GB/s; +0.22 bit/weight on those tensors, ~0.007 bit on Llama-3-8B)."""
SMALL_NUMEL = 1 << 23
"""Tensors under this many weights (~8M: Llama-3-8B's k/v projections, not q/o) get :data:`SMALL_STEPS`."""
DEFAULT_LANES = 256
"""Lanes per tile (one per GPU thread at 8 warps)."""
DEFAULT_ELEMS = 4
"""Elements per lane and step for lossless tensors (lossy ones use 1: their
sub-byte tails are packed across neighbouring lanes)."""
REBUILD_GROWTH = kstream.REBUILD_GROWTH
_HISTOGRAM_CHUNK = 1 << 24


def _use_kernel(layout: Layout, elems: int, device: torch.device, backend: str) -> bool:
    if backend == "reference":
        return False
    eligible = layout.dtype == torch.bfloat16 and (elems in (1, 2, 4) if layout.lossless else elems == 1)
    if backend == "triton":
        if not eligible:
            raise ValueError(f"the Triton codec handles bf16 (lossy: one element per lane and step), "
                             f"not {layout.dtype} with {elems} elements per step")
        return True
    if backend != "auto":
        raise ValueError(f"backend must be 'auto', 'triton' or 'reference', not {backend!r}")

    return eligible and device.type == "cuda" and triton_available()


def default_steps(numel: int, elems: int = DEFAULT_ELEMS) -> int:
    """Steps per lane :func:`compress` picks: :data:`SMALL_STEPS` under :data:`SMALL_NUMEL` weights, else
    :data:`DEFAULT_STEPS` (scaled so that a lane codes as many symbols at any ``elems``). Stored per tensor,
    so tensors saved with another geometry load and decode as they were.

    Example:
        >>> default_steps(1024 * 4096), default_steps(4096 * 4096), default_steps(4096 * 4096, elems=1)
        (16, 32, 128)
    """
    steps = SMALL_STEPS if numel < SMALL_NUMEL else DEFAULT_STEPS
    return steps * DEFAULT_ELEMS // elems


def _lanes_for(numel: int, steps: int, lanes: int, elems: int) -> int:
    """Fewer lanes for small tensors, so a bias vector does not carry 256 lane counts."""
    needed = 1 << max(0, math.ceil(math.log2(max(1, -(-numel // (steps * elems))))))
    return max(16, min(lanes, needed))


class CompressedTensor:
    """A float tensor stored as entropy-coded exponents plus raw sign/mantissa bits.

    Build one with :func:`compress` or :meth:`from_state_dict`.

    Example:
        >>> w = torch.randn(256, 256).bfloat16()
        >>> ct = compress(w)
        >>> torch.equal(ct.decompress().view(torch.int16), w.view(torch.int16))
        True
        >>> ct.bits_per_weight < 16
        True
    """

    def __init__(self, layout: Layout, shape, device, steps: int, lanes: int, elems: int, code_lengths: np.ndarray,
                 name=None):
        self.layout = layout
        self.shape = torch.Size(shape)
        self.numel = math.prod(self.shape)
        self.steps, self.lanes, self.elems = steps, lanes, elems
        self.tiles = codec.num_tiles(self.numel, steps, lanes, elems)
        self.name = name
        device = torch.device(device)
        self.lane_words = torch.zeros(self.tiles * lanes, dtype=torch.uint8, device=device)
        self.tile_base = torch.zeros(self.tiles + 1, dtype=torch.int64, device=device)
        # Rounded up to whole 32-bit words so kernels may load a lane's 4 tail bytes at once.
        self.tails = torch.zeros(tails_capacity(self.numel, layout.tail_bits), dtype=torch.uint8, device=device)
        self._tails_used = tail_nbytes(self.numel, layout.tail_bits)
        self.stream = torch.zeros(codec.STREAM_PAD_WORDS, dtype=torch.int32, device=device)
        self._words = codec.STREAM_PAD_WORDS  # used words, padding included (lags a sync-free encode)
        self._coded_seen = 0  # coded exponent bits of the last encode seen on the host
        self._coded_bits_at_build = 1
        self._headroom_shift = kstream.HEADROOM_SHIFT  # earned: see neutrain.compress.stream
        self.status = kstream.StreamStatus(device)
        self._scratch = None  # kernel pass buffers, made on first use (kstream.kernel_scratch)
        self._set_code(code_lengths)
        self.rebuilds = 0
        self._pending_symbols = None

    # ----------------------------------------------------------------- properties
    @property
    def dtype(self) -> torch.dtype:
        return self.layout.dtype

    @property
    def device(self) -> torch.device:
        return self.stream.device

    @property
    def stream_words(self) -> int:
        """Used stream words, padding included (waits for a pending sync-free encode's status)."""
        kstream.settle(self, wait=True)
        return self._words

    @property
    def mantissa_bits(self) -> int | None:
        return self.layout.mantissa_bits

    @property
    def nbytes(self) -> int:
        """Bytes held on the device: streams, tables and code tables (capacity, not just use)."""
        buffers = (self.stream, self.tails, self.lane_words, self.tile_base, self.enc_table, self.lut)
        return sum(b.numel() * b.element_size() for b in buffers) + self.code_lengths.size

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / max(self.numel, 1)

    def __repr__(self) -> str:
        mode = "lossless" if self.layout.lossless else f"{self.layout.kept} mantissa bits"
        return (f"CompressedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, {mode}, "
                f"{self.bits_per_weight:.2f} bits/weight, device={self.device})")

    # ------------------------------------------------------------------- encoding
    def encodes_lossless_kernels(self, backend: str = "auto") -> bool:
        """Whether :meth:`recompress_` runs the lossless Triton kernels (:mod:`neutrain.compress.stream`)."""
        return self.layout.lossless and _use_kernel(self.layout, self.elems, self.device, backend)

    def _set_code(self, lengths: np.ndarray) -> None:
        device = self.stream.device
        self.code_lengths = np.asarray(lengths, dtype=np.uint8)
        self.enc_table = huffman.encode_table(self.code_lengths).to(device)
        self.lut = huffman.decode_lut(self.code_lengths).to(device)

    def _symbols(self, x: torch.Tensor) -> torch.Tensor:
        if splits_bytewise(self.layout, self.device):
            return split_bf16_bytes(x)[0]
        return split(to_bits(x), self.layout)[0]

    def _rebuild_code(self, x: torch.Tensor) -> None:
        # In chunks: the int64 temporaries of a whole 0.5 G-element embedding would take ~20 GB.
        flat = x.reshape(-1)
        hist = sum((huffman.histogram(self._symbols(chunk)) for chunk in flat.split(_HISTOGRAM_CHUNK)),
                   np.zeros(huffman.NUM_SYMBOLS, dtype=np.int64))
        self._set_code(huffman.build_code(hist))
        self.rebuilds += 1

    def _count_reference(self, x: torch.Tensor, fast: bool = False) -> tuple[int, int]:
        """Reference pass 1 (``fast``: compiled, :mod:`~neutrain.compress.codec_cpu`); returns
        (stream words incl. padding, coded exponent bits)."""
        if fast and codec_cpu.fuses(self.layout):  # the kernels split the floats themselves
            return codec_cpu.encode(self, x)
        if splits_bytewise(self.layout, self.device):
            symbols, tails = split_bf16_bytes(x)  # an 8-bit tail is its own packed byte
        else:
            symbols, tails = split(to_bits(x), self.layout)
            tails = pack_tails(tails, self.layout.tail_bits)
        self._pending_symbols = symbols  # reused by pass 2 of the same encode
        self.tails[: self._tails_used].copy_(tails)
        if fast:
            return codec_cpu.encode(self, x, symbols)
        lane_words, tile_base, coded = codec.count_lanes(symbols, self.enc_table, self.steps, self.lanes, self.elems)
        self.lane_words.copy_(lane_words)
        self.tile_base.copy_(tile_base)
        words, coded_bits = torch.stack([self.tile_base[-1], coded.to(torch.int64)]).tolist()
        return words + codec.STREAM_PAD_WORDS, coded_bits

    def _encode(self, x: torch.Tensor, backend: str, fresh_code: bool, sync: bool = True) -> None:
        x = x.detach()
        if x.shape != self.shape or x.dtype != self.dtype:
            raise ValueError(f"expected a {self.dtype} tensor of shape {tuple(self.shape)}, "
                             f"got {x.dtype} {tuple(x.shape)}")
        x = x.to(self.device).contiguous()
        if _use_kernel(self.layout, self.elems, self.device, backend):
            if self.layout.lossless:
                kstream.encode_lossless(self, x, fresh_code, sync)
            else:
                kstream.encode_lossy(self, x, fresh_code)
            return
        fast = codec_cpu.enabled(self.device, backend)
        words, coded_bits = self._count_reference(x, fast)
        if not fresh_code and coded_bits > (1 + REBUILD_GROWTH) * self._coded_bits_at_build:
            # Weights drifted: the old code still encodes everything (escapes), but worse.
            self._rebuild_code(x)
            words, coded_bits = self._count_reference(x, fast)
            fresh_code = True
        if fresh_code:
            self._coded_bits_at_build = max(coded_bits, 1)
        if words > self.stream.numel():
            capacity = kstream.capacity_for(words, self._headroom_shift)
            self.stream = torch.zeros(capacity, dtype=torch.int32, device=self.device)
        self._words, self._coded_seen = words, coded_bits
        self.stream[words - codec.STREAM_PAD_WORDS : words].zero_()
        symbols, self._pending_symbols = self._pending_symbols, None
        if fast:
            codec_cpu.pack(self, symbols)
            return
        codec.pack_lanes(symbols, self.enc_table, self.lane_words, self.tile_base, self.stream,
                         self.steps, self.lanes, self.elems)

    def recompress_(self, t: torch.Tensor, *, backend: str = "auto", sync: bool = True) -> "CompressedTensor":
        """Re-encode new values of the same shape and dtype in place.

        Reuses all buffers while the stream fits (growing it otherwise, with the
        headroom of :mod:`~neutrain.compress.stream`) and the current code while the exponent stream stays within
        :data:`REBUILD_GROWTH` of its size when the code was built.

        ``sync=False`` (lossless bf16 on the GPU; what training calls) never reads
        back to the host: the decisions to grow or rebuild use the status of the
        previous encode, and an encode that does not fit leaves the tensor as it was
        and raises :class:`~neutrain.compress.stream.StreamOverflowError` at the next
        encode or save (see :mod:`neutrain.compress.stream`). Elsewhere it is ignored.

        Example:
            >>> ct = compress(torch.randn(8, 8).bfloat16())
            >>> w = torch.randn(8, 8).bfloat16()
            >>> torch.equal(ct.recompress_(w).decompress(), w)
            True
        """
        self._encode(t, backend, fresh_code=False, sync=sync)
        return self

    # ------------------------------------------------------------------- decoding
    def decompress(self, out: torch.Tensor | None = None, *, backend: str = "auto") -> torch.Tensor:
        """Decode into ``out`` (contiguous, same shape, dtype and device) or a new tensor.

        On CUDA with bf16 this is one kernel launch: no allocation when ``out`` is
        given and never a host synchronisation.
        """
        if out is None:
            out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        elif out.shape != self.shape or out.dtype != self.dtype or out.device != self.device:
            raise ValueError(f"out must be {self.dtype} {tuple(self.shape)} on {self.device}, "
                             f"got {out.dtype} {tuple(out.shape)} on {out.device}")
        elif not out.is_contiguous():
            raise ValueError("out must be contiguous")
        if _use_kernel(self.layout, self.elems, self.device, backend):
            from neutrain.kernels import codec as kcodec  # lazy: Triton, GPU path only

            kcodec.decode(self.stream, self.lane_words, self.tile_base, self.tails, self.lut, out,
                          self.numel, self.steps, self.lanes, self.layout.kept, self.elems)
            return out
        if self.numel:
            if codec_cpu.enabled(self.device, backend):
                if codec_cpu.fuses(self.layout):
                    return codec_cpu.decode_into(self, out)
                symbols = codec_cpu.decode_symbols(self)[: self.numel]
            else:
                symbols = codec.decode_tiles_jumping(self.stream, self.lane_words, self.tile_base, self.lut,
                                                     self.numel, self.steps, self.lanes, elems=self.elems)[: self.numel]
            if splits_bytewise(self.layout, self.device):
                return merge_bf16_bytes(symbols, self._tails_view(), out)
            index = torch.arange(self.numel, device=self.device)
            tails = unpack_tails(self._tails_view(), self.layout.tail_bits, index)
            out.view(-1).copy_(from_bits(merge(symbols.long(), tails, self.layout), self.dtype))
        return out

    def decompress_rows(self, index: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
        """Decode only rows ``index`` of dimension 0 (for embeddings): ``index.shape + shape[1:]``.

        Decodes the few tiles that hold those rows (or everything, when that is less work).
        """
        if not self.shape:
            raise ValueError("decompress_rows needs a tensor with at least one dimension")
        index = torch.as_tensor(index, device=self.device).to(torch.int64)
        row_len = math.prod(self.shape[1:])
        tile_len = self.steps * self.lanes * self.elems
        span = -(-row_len // tile_len) + 1  # tiles one row can touch
        if index.numel() * span >= self.tiles or row_len == 0:
            return self.decompress(backend=backend)[index]
        flat = index.reshape(-1)
        first = flat * row_len
        first_tile = first // tile_len
        tile_ids = (first_tile[:, None] + torch.arange(span, device=self.device)).clamp(max=self.tiles - 1)
        tile_ids = tile_ids.reshape(-1)
        pick = (torch.arange(flat.numel(), device=self.device)[:, None] * (span * tile_len)
                + (first - first_tile * tile_len)[:, None] + torch.arange(row_len, device=self.device))
        if _use_kernel(self.layout, self.elems, self.device, backend):
            from neutrain.kernels import codec as kcodec  # lazy: Triton, GPU path only

            scratch = torch.empty(tile_ids.numel() * tile_len, dtype=self.dtype, device=self.device)
            kcodec.decode(self.stream, self.lane_words, self.tile_base, self.tails, self.lut, scratch,
                          self.numel, self.steps, self.lanes, self.layout.kept, self.elems, tile_ids=tile_ids)
            rows = scratch[pick]
        else:
            if codec_cpu.enabled(self.device, backend):
                symbols = codec_cpu.decode_symbols(self, tile_ids)[pick]
            else:
                symbols = codec.decode_tiles_jumping(self.stream, self.lane_words, self.tile_base, self.lut,
                                                     self.numel, self.steps, self.lanes, tiles=tile_ids,
                                                     elems=self.elems)[pick]
            elements = first[:, None] + torch.arange(row_len, device=self.device)
            tails = unpack_tails(self._tails_view(), self.layout.tail_bits, elements)
            bits = merge(symbols.long(), tails, self.layout)
            rows = from_bits(bits.reshape(-1), self.dtype)
        return rows.reshape(*index.shape, *self.shape[1:])

    # ------------------------------------------------------------ moving, saving
    def _tails_view(self) -> torch.Tensor:
        return self.tails[: self._tails_used]

    def _blobs(self) -> dict[str, torch.Tensor]:
        # The last sync-free encode's status first: its used length and coded bits go into the blobs.
        kstream.settle(self, wait=True)
        return {
            "header": fmt.make_header(self.layout, self.shape, self.steps, self.lanes, self.elems,
                                      self._coded_bits_at_build, self._coded_seen),
            "code_lengths": torch.from_numpy(self.code_lengths.copy()),
            "lane_words": self.lane_words,
            "tile_base": self.tile_base,
            "stream": self.stream[: self.stream_words],
            "tails": self._tails_view(),
        }

    def to(self, device) -> "CompressedTensor":
        """A copy on ``device`` (self when already there)."""
        device = torch.device(device)
        if device == self.device:
            return self
        blobs = self._blobs()
        return CompressedTensor._from_blobs(blobs, self.name, device, (self._coded_bits_at_build, self._coded_seen),
                                            self.layout, self.shape, (self.steps, self.lanes, self.elems))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Plain tensors (contiguous, safetensors-ready) with a checksum; see :mod:`neutrain.compress.format`.

        Like ``nn.Module.state_dict``, the blobs are views of this tensor's own storage, not copies:
        a clone of every blob was a second copy of the model on the GPU each time a checkpoint was
        saved. Writers copy one blob at a time to the host; clone to keep a snapshot.
        """
        return fmt.seal({key: value.detach().contiguous() for key, value in self._blobs().items()}, self.name)

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], name: str | None = None, device=None):
        """Rebuild from :meth:`state_dict`, verifying the checksum first.

        Raises:
            CorruptTensorError: naming the tensor (``name``, else the stored name).
        """
        label, layout, shape, (steps, lanes, elems), lengths, coded = fmt.open_sealed(state, name)
        blobs = dict(state)
        blobs["code_lengths"] = torch.from_numpy(lengths)
        target = torch.device(device) if device is not None else state["stream"].device
        return cls._from_blobs(blobs, label, target, coded, layout, shape, (steps, lanes, elems))

    @classmethod
    def _from_blobs(cls, blobs, name, device, coded: tuple[int, int], layout, shape, geometry):
        """``coded``: (coded exponent bits when the code was built, coded exponent bits of this encoding)."""
        ct = cls(layout, shape, device, *geometry, blobs["code_lengths"].cpu().numpy(), name=name)
        ct.lane_words.copy_(blobs["lane_words"])
        ct.tile_base.copy_(blobs["tile_base"])
        ct._tails_view().copy_(blobs["tails"])
        # The stream gets the headroom a fresh encode gives it (the blob holds only the used words). Without it
        # the first sync-free re-encode after a resume grew every stream, a new one allocated while the old
        # still lived: Llama-3-8B's resumed first step asked 176 MiB more (the lm_head's grown stream) at an
        # 11 GiB budget the uninterrupted run met, and left 1.3 GiB of the reserve in holes at 22 GiB.
        words = blobs["stream"].numel()
        ct.stream = torch.zeros(kstream.capacity_for(words, ct._headroom_shift), dtype=torch.int32, device=device)
        ct.stream[:words].copy_(blobs["stream"])
        ct._words = words
        # Both decide when the code is rebuilt next (stream.prepare_sync_free, blocks.block_recode): restored
        # as the saved tensor had them, a loaded tensor re-encodes the next values into the same bytes.
        ct._coded_bits_at_build, ct._coded_seen = coded
        return ct


def compress(t: torch.Tensor, mantissa_bits: int | None = None, *, steps: int | None = None,
             lanes: int = DEFAULT_LANES, elems: int | None = None, backend: str = "auto",
             name: str | None = None) -> CompressedTensor:
    """Compress a bf16, fp16 or fp32 tensor.

    Args:
        t: The tensor (any shape and strides; it stays on its device).
        mantissa_bits: None for lossless; 0, 1, 3 (or 7 for fp16/fp32) to keep
            that many mantissa bits, rounding to nearest even.
        steps, lanes, elems: Tile geometry: steps per lane, lanes per tile (shrinks
            for small tensors), elements per lane and step (default 4 lossless,
            1 lossy; default steps: :func:`default_steps`).
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.
        name: Name used in error messages and saved with the state dict.

    Example:
        >>> ct = compress(torch.randn(4, 5).bfloat16(), mantissa_bits=3)
        >>> ct.decompress().shape
        torch.Size([4, 5])
    """
    layout = layout_for(t.dtype, mantissa_bits)
    if elems is None:
        elems = DEFAULT_ELEMS if layout.lossless else 1
    if steps is None:
        steps = default_steps(t.numel(), elems)
    if min(steps, lanes, elems) < 1 or lanes & (lanes - 1) or elems & (elems - 1):
        raise ValueError(f"bad geometry steps={steps} lanes={lanes} elems={elems} (lanes, elems: powers of two)")
    lanes = _lanes_for(t.numel(), steps, lanes, elems)
    ct = CompressedTensor(layout, t.shape, t.device, steps, lanes, elems, huffman.build_code(np.zeros(1)), name=name)
    ct._rebuild_code(t.detach())
    ct.rebuilds = 0
    ct._encode(t, backend, fresh_code=True)
    return ct
