"""``CompressedWeight``: one compressed matrix, its optimizer key and its decode buffers.

A compressed module never owns a dense weight. It owns (or shares, when tied) a
``CompressedWeight``, which holds

* the codec's ``CompressedTensor`` (``ct``),
* ``key``: an empty ``nn.Parameter`` that stands for the weight in the
  optimizer's ``param_groups`` (so lr schedules, per-group settings and
  ``optimizer.state`` work as for any parameter) and, passed as an input to the
  module's autograd function, guarantees that the backward runs even when the
  module's input needs no gradient,
* the decode path: ``decode()`` writes the weight into a per-device buffer that
  is shared by all layers (decoded weights never outlive their use).

It also implements the optimizer's ``WeightIO`` protocol: ``read()`` returns the
decoded weight (reusing the buffer if it still holds this version), ``write_()``
re-encodes the updated weight in place.
"""

from __future__ import annotations

import torch

from neutrain.optim.fused import COMPRESSED_KEY_ATTR


class DecodeBuffers:
    """Reusable flat decode buffers, per (device, dtype) and slot, tagged with their content.

    One buffer per slot, grown to the largest weight decoded into it. A tag
    ``(weight id, version)`` records what a buffer holds, so a weight decoded in
    backward right after it was decoded for the update is not decoded twice,
    and a stale buffer is never mistaken for current data.
    """

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._tags: dict[tuple, tuple] = {}

    def view(self, weight: "CompressedWeight", slot: int = 0) -> torch.Tensor:
        key = (weight.device, weight.dtype, slot)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < weight.numel:
            self._buffers.pop(key, None)  # free the old one before allocating the larger
            buffer = torch.empty(weight.numel, dtype=weight.dtype, device=weight.device)
            self._buffers[key] = buffer
        self._tags[key] = (id(weight), weight.version)
        return buffer[: weight.numel].view(weight.shape)

    def cached(self, weight: "CompressedWeight") -> torch.Tensor | None:
        for key, tag in self._tags.items():
            if tag == (id(weight), weight.version):
                return self._buffers[key][: weight.numel].view(weight.shape)
        return None

    def invalidate(self, weight: "CompressedWeight") -> None:
        for key, tag in list(self._tags.items()):
            if tag[0] == id(weight):
                del self._tags[key]

    def clear(self) -> None:
        """Free every buffer (e.g. before measuring memory)."""
        self._buffers.clear()
        self._tags.clear()

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


DECODE_BUFFERS = DecodeBuffers()
"""The process-wide decode buffers shared by every compressed module."""


class CompressedWeight:
    """A compressed weight plus the placeholder parameter the optimizer keys it by.

    Args:
        ct: a ``neutrain.compress.CompressedTensor``.
        requires_grad: whether the weight is trained (frozen weights get no update).
        name: used in error messages.

    Example:
        >>> from neutrain.compress import compress
        >>> w = torch.randn(4, 3).bfloat16()
        >>> cw = CompressedWeight(compress(w))
        >>> torch.equal(cw.decode(), w), cw.key.numel()
        (True, 0)
    """

    def __init__(self, ct, requires_grad: bool = True, name: str | None = None):
        self.ct = ct
        self.name = name
        self.version = 0
        self.decodes = 0  # full decodes run (cache hits excluded): lets tests see recomputes decode again
        self.optimizer = None
        key = torch.nn.Parameter(torch.empty(0, dtype=ct.dtype, device=ct.device), requires_grad=requires_grad)
        setattr(key, COMPRESSED_KEY_ATTR, True)
        self.key = key

    # ------------------------------------------------------------ properties
    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.ct.shape)

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self.ct.dtype

    @property
    def device(self) -> torch.device:
        return self.ct.device

    @property
    def nbytes(self) -> int:
        return int(self.ct.nbytes)

    @property
    def trainable(self) -> bool:
        return self.key.requires_grad

    # ---------------------------------------------------------------- decode
    def decode(self, slot: int = 0) -> torch.Tensor:
        """The dense weight, in a shared buffer valid until the next decode into ``slot``."""
        cached = DECODE_BUFFERS.cached(self)
        if cached is not None:
            return cached
        self.decodes += 1
        return self.ct.decompress(out=DECODE_BUFFERS.view(self, slot))

    def decode_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` of the weight (a fresh tensor of shape ``index.shape + shape[1:]``)."""
        return self.ct.decompress_rows(index)

    def dense(self) -> torch.Tensor:
        """A fresh dense copy (for export and inspection; not used by training)."""
        return self.ct.decompress()

    # ------------------------------------------------------- optimizer side
    def read(self) -> torch.Tensor:
        return self.decode()

    def write_(self, weight: torch.Tensor) -> None:
        self.ct.recompress_(weight)
        self.version += 1
        DECODE_BUFFERS.invalidate(self)

    def replace_(self, ct) -> None:
        """Swap in another compressed tensor of the same shape (checkpoint loading)."""
        if tuple(ct.shape) != tuple(self.shape) or ct.dtype != self.dtype:
            raise ValueError(f"{self.name}: loaded {ct.dtype} {tuple(ct.shape)} for {self.dtype} {tuple(self.shape)}")
        self.ct = ct
        self.version += 1
        DECODE_BUFFERS.invalidate(self)

    def apply_grad(self, grad: torch.Tensor) -> None:
        """Hand a weight gradient to the bound fused optimizer (which updates and re-encodes)."""
        if self.optimizer is None:
            raise RuntimeError(
                f"compressed weight {self.name or ''} received a gradient but no fused optimizer is bound: "
                "build one over model.parameters() and call optimizer.bind(model), or freeze the weight "
                "with requires_grad_(False)."
            )
        self.optimizer.consume_grad_(self.key, grad, self)
