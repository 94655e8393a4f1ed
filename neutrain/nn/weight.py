"""``CompressedWeight``: one compressed matrix, its optimizer key and its decode buffers.

A compressed module never owns a dense weight. It owns (or shares, when tied) a
``CompressedWeight``, which holds

* the codec's ``CompressedTensor`` (``ct``),
* ``key``: an empty ``nn.Parameter`` that stands for the weight in the
  optimizer's ``param_groups`` (so lr schedules, per-group settings and
  ``optimizer.state`` work as for any parameter) and, passed as an input to the
  module's autograd function, guarantees that the backward runs even when the
  module's input needs no gradient,
* the decode path: ``decode()`` writes the weight into per-device buffers that
  are shared by all layers (:mod:`neutrain.nn.buffers`; decoded weights never
  outlive their use),
* ``compute_dtype``: the dtype the modules compute in. It is the stored dtype
  unless set otherwise: bf16 storage under fp32 compute is the CPU setting, where
  bf16 matrix products run about 12x slower than fp32 ones; the decoded weight is
  then upcast per use, gradients arrive in fp32 and the fused update rounds back
  to the stored bf16.

While a serving mode holds the weight in another exact form, a :class:`PayloadStandIn` takes the compressed
tensor's place: decodes read that form, and :attr:`CompressedWeight.ct` restores the payload first
(:mod:`neutrain.decode.zgemv_release`).

It also implements the optimizer's ``WeightIO`` protocol: ``read()`` returns the
decoded weight (reusing the buffer if it still holds this version), ``write_()``
re-encodes the updated weight in place; ``row_blocks()`` / ``write_blocks_()`` do the
same a row block at a time (:mod:`neutrain.nn.row_blocks`), for the streamed updates of
the vocabulary matrices, so those are never decoded whole.
"""

from __future__ import annotations

import copy

import torch

from neutrain.nn.buffers import DECODE_BUFFERS
from neutrain.nn.row_blocks import RowBlocks, row_blocks
from neutrain.optim.fused import COMPRESSED_KEY_ATTR


class PayloadStandIn:
    """What a :class:`CompressedWeight` holds instead of its compressed tensor while another exact form of the
    weight serves it and the payload's memory is freed (:mod:`neutrain.decode.zgemv_release`).

    It has the tensor's ``shape``, ``dtype``, ``device`` and ``name``; decodes (:meth:`decompress`,
    :meth:`decompress_rows`) read the other form; :meth:`restore` rebuilds the exact payload, bit for bit, and
    :attr:`CompressedWeight.ct` calls it, so anything that needs the payload itself (saving, an optimizer's
    write, export) gets it back. Any other attribute of a compressed tensor raises, naming the weight: code that
    reached past :attr:`CompressedWeight.ct` to the payload's buffers fails loudly instead of reading freed memory.
    """

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    name: str | None
    nbytes: int = 0

    def decompress(self, out: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def decompress_rows(self, index: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def restore(self):
        """The exact compressed tensor, rebuilt (the caller installs it)."""
        raise NotImplementedError

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"compressed weight {self.__dict__.get('name') or '<unnamed>'!r}: its payload is released "
                             f"(another exact form, e.g. a zgemv layout, serves it); '{name}' is not there. Read it "
                             "through CompressedWeight.ct, which restores the payload, or detach_zgemv(model) first")


class CompressedWeight:
    """A compressed weight plus the placeholder parameter the optimizer keys it by.

    Args:
        ct: a ``neutrain.compress.CompressedTensor``.
        requires_grad: whether the weight is trained (frozen weights get no update).
        name: used in error messages.
        compute_dtype: dtype of the modules' products (default: the stored dtype).

    Example:
        >>> from neutrain.compress import compress
        >>> w = torch.randn(4, 3).bfloat16()
        >>> cw = CompressedWeight(compress(w))
        >>> torch.equal(cw.decode(), w), cw.key.numel()
        (True, 0)
    """

    def __init__(self, ct, requires_grad: bool = True, name: str | None = None,
                 compute_dtype: torch.dtype | None = None):
        self._ct = ct
        self.group = None  # a neutrain.nn.groups.WeightGroup: decoded and re-encoded with its layer
        self.group_index = 0
        self.compute_dtype = compute_dtype or ct.dtype
        self.name = name
        self.version = 0
        self.decodes = 0  # full decodes run (cache hits excluded): lets tests see recomputes decode again
        self.optimizer = None
        self.large = False  # embedding / lm_head: decoded into the large buffer, never prefetched
        self.home = None  # a neutrain.nn.weight_offload.WeightOffload when the payload lives in host memory
        self.reader = None  # the chunked loss's RowReader while it reads this weight (neutrain.nn.row_blocks)
        # In the compute dtype: model.dtype (what transformers reads from the parameters) is the activations' dtype.
        key = torch.nn.Parameter(torch.empty(0, dtype=self.compute_dtype, device=ct.device),
                                 requires_grad=requires_grad)
        setattr(key, COMPRESSED_KEY_ATTR, True)
        self.key = key

    def __deepcopy__(self, memo):
        """A copy takes the compressed bytes as they are, so an update still waiting in the layer group's buffer is
        encoded first (the group itself copies unbound: :meth:`neutrain.nn.groups.WeightGroup.__deepcopy__`)."""
        if self.group is not None and any(self.group.pending):
            self.group.flush()
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            new.__dict__[name] = copy.deepcopy(value, memo)
        return new

    # ------------------------------------------------------------ properties
    @property
    def ct(self):
        """The compressed tensor, current: an update still waiting in its layer group's buffer is encoded first,
        and a released payload (:class:`PayloadStandIn`) is restored, exact, and kept."""
        group = self.group
        if group is not None and group.pending[self.group_index]:
            group.flush()
        if isinstance(self._ct, PayloadStandIn):
            self._ct = self._ct.restore()
        return self._ct

    @ct.setter
    def ct(self, ct) -> None:
        self._ct = ct

    @property
    def released(self) -> bool:
        """Whether the payload is released and a :class:`PayloadStandIn` serves the decodes."""
        return isinstance(self._ct, PayloadStandIn)

    def _source(self):
        """What a decode reads: the payload, or the stand-in's exact form without restoring the payload."""
        return self._ct if isinstance(self._ct, PayloadStandIn) else self.ct

    @property
    def shape(self) -> torch.Size:
        return self._ct.shape

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self._ct.dtype

    @property
    def device(self) -> torch.device:
        return self._ct.device

    @property
    def nbytes(self) -> int:
        return int(self._source().nbytes)

    @property
    def trainable(self) -> bool:
        return self.key.requires_grad

    # ---------------------------------------------------------------- decode
    def decode(self, slot: str | None = None) -> torch.Tensor:
        """The dense weight: in its kept buffer (valid until the next ``write_``), or in a shared decode
        buffer (valid until two more layer decodes), see :mod:`neutrain.nn.buffers`. ``slot`` names the shared
        buffer instead (``HELD_SLOT``: a third weight that must outlive two more decodes)."""
        group = self.group
        if group is not None:
            return group.view(self)
        cached = DECODE_BUFFERS.cached(self)
        if cached is not None:
            return cached
        self.decodes += 1
        self._resident()
        out = DECODE_BUFFERS.kept_view(self)  # within the keep budget: a buffer of its own, reused until write_
        if out is None:
            out = DECODE_BUFFERS.view(self, slot or DECODE_BUFFERS.slot_for(self))
        return self._decompress_into(out)

    def decode_into(self, out: torch.Tensor) -> torch.Tensor:
        """Decode into ``out`` (contiguous, the weight's shape and stored dtype), e.g. a member's row block of
        a fused projection buffer (:mod:`neutrain.decode.fused_projections`); no decode buffer is used or kept."""
        self.decodes += 1
        self._resident()
        return self._decompress_into(out)

    def _decompress_into(self, out: torch.Tensor) -> torch.Tensor:
        out = self._source().decompress(out=out)
        if self.home is not None:
            self.home.decoded(self)  # NEUTRAIN_OFFLOAD_SYNC_DEBUG: name a decode that faulted
        return out

    def decode_for_compute(self, slot: str | None = None) -> torch.Tensor:
        """:meth:`decode`, upcast to :attr:`compute_dtype` when that differs (a temporary per use)."""
        weight = self.decode(slot)
        return weight if weight.dtype == self.compute_dtype else weight.to(self.compute_dtype)

    def decode_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` of the weight in :attr:`compute_dtype` (a fresh ``index.shape + shape[1:]`` tensor)."""
        self._resident()
        return self._source().decompress_rows(index).to(self.compute_dtype)

    def dense(self) -> torch.Tensor:
        """A fresh dense copy (for export and inspection; not used by training)."""
        self._resident()
        return self._source().decompress()

    def _resident(self, writing: bool = False) -> None:
        """Offloaded weights: bring the payload to the device first (a no-op when it is there)."""
        if self.home is not None:
            self.home.fetch(self, writing)

    def saved_ct(self):
        """The compressed tensor to save: the host store's copy for an offloaded weight (no device copy); for a
        released payload an exact copy rebuilt for the save, the payload staying released (memory for one weight)."""
        if isinstance(self._ct, PayloadStandIn):
            return self._ct.restore()
        return self.ct if self.home is None else self.home.host_ct(self)

    # ------------------------------------------------------- optimizer side
    def read(self) -> torch.Tensor:
        return self.decode()

    def count_into(self, weight: torch.Tensor):
        """The encode's pass-1 target for an update kernel that counts code lengths as it stores
        (:mod:`neutrain.compress.counted`), or None; :meth:`write_` then reads the weight once."""
        from neutrain.compress import counted  # lazy: only the fused update asks

        if not counted.IN_UPDATE or self.home is not None or self.group is not None:
            return None
        return counted.begin(self.ct, weight)

    def write_(self, weight: torch.Tensor) -> None:
        # No host read: the re-encode sizes its stream on the device (neutrain.compress.stream),
        # so backward never waits for the GPU here.
        if self.group is not None and self.group.took(self, weight):
            return  # updated in its layer's buffer: encoded with the layer (neutrain.nn.groups)
        self._resident(writing=True)
        self.ct.recompress_(weight, sync=False)
        if self.home is not None:
            self.home.written(self)  # the new bytes go back to host memory, asynchronously
        self.release()
        self.version += 1
        DECODE_BUFFERS.invalidate(self)

    def row_blocks(self, chunk_rows: int) -> RowBlocks | None:
        """The weight as row blocks for an update by chunks of ``chunk_rows`` rows, or None (read it whole)."""
        return row_blocks(self, chunk_rows)

    def write_blocks_(self, blocks: RowBlocks) -> None:
        """Finish an update through :meth:`row_blocks`: the last blocks re-encoded, the new encoding in."""
        blocks.close()
        self.release()
        self.version += 1
        DECODE_BUFFERS.invalidate(self)

    def release(self) -> None:
        """Free the decode buffer (or row reader) of a large (embedding/lm_head) weight after use."""
        self.reader = None
        if self.large:
            DECODE_BUFFERS.release_large(self)

    def replace_(self, ct) -> None:
        """Swap in another compressed tensor of the same shape (checkpoint loading).

        The stored dtype may differ (a bf16-stored checkpoint loaded into a model built in
        fp32); the module keeps computing in :attr:`compute_dtype`.
        """
        if tuple(ct.shape) != tuple(self.shape):
            raise ValueError(f"{self.name}: loaded {ct.dtype} {tuple(ct.shape)} for {self.dtype} {tuple(self.shape)}")
        if self.group is not None:
            if (ct.dtype, ct.device) != self.group.key:  # the group's buffers hold the old dtype: ungroup
                self.group.dissolve()
            else:
                self.group.forget(self)
        self._ct = ct
        if self.home is not None:
            self.home.adopt(self)
        self.version += 1
        DECODE_BUFFERS.invalidate(self)

    def streamed_chunk_rows(self) -> int | None:
        """Rows per chunk if the bound optimizer takes this weight's gradient row chunk by row chunk."""
        rows_of = getattr(self.optimizer, "streamed_chunk_rows", None)
        return rows_of(self.key, self.shape) if rows_of is not None else None

    def apply_streamed_grad(self, grad_rows, sumsq) -> None:
        """Hand the optimizer a gradient as recomputable row chunks, with its squared norm or a callable
        measuring it (see ``FusedOptimizer.apply_streamed_``)."""
        self.optimizer.apply_streamed_(self.key, self, grad_rows, sumsq)

    def apply_grad(self, grad: torch.Tensor) -> None:
        """Hand a weight gradient to the bound fused optimizer (which updates and re-encodes)."""
        if self.optimizer is None:
            raise RuntimeError(
                f"compressed weight {self.name or ''} received a gradient but no fused optimizer is bound: "
                "build one over model.parameters() and call optimizer.bind(model), or freeze the weight "
                "with requires_grad_(False)."
            )
        self.optimizer.consume_grad_(self.key, grad, self)
