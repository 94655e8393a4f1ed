"""Shape-only stand-ins for compressed weights, while wrapping code asks only for metadata.

Why: peft (and other wrappers) read ``module.weight`` of every layer it wraps to learn its device
and dtype (``LoraModel._replace_module``, twice per adapter sub-module). ``.weight`` of a
compressed module is a full decode (:meth:`CompressedWeight.dense`), so LoRA setup on a compressed
135M model decoded each matrix a dozen times and took 17 minutes before step 1. Inside
:func:`shape_only_weights`, ``.weight`` is a :class:`WeightStandIn` instead: it has the weight's
shape, dtype and device, holds one element of memory, and refuses any read of values, so a
wrapper that needed the values fails loudly instead of computing with zeros.

Example:
    >>> import torch
    >>> from neutrain.compress import compress
    >>> from neutrain.nn import CompressedLinear, CompressedWeight
    >>> layer = CompressedLinear(CompressedWeight(compress(torch.randn(4, 3).bfloat16())))
    >>> with shape_only_weights():
    ...     w = layer.weight
    >>> w.shape, w.dtype, layer.compressed.decodes
    (torch.Size([4, 3]), torch.bfloat16, 0)
    >>> w.sum()
    Traceback (most recent call last):
    RuntimeError: WeightStandIn(shape=(4, 3), dtype=torch.bfloat16, device=cpu): a compressed weight's values were read inside shape_only_weights() (sum); decode it with .compressed.dense()
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

_ACTIVE = threading.local()

# Tensor attributes and methods that describe a tensor without reading its values.
_METADATA = frozenset({
    "shape", "dtype", "device", "ndim", "layout", "is_meta", "is_cuda", "is_cpu", "is_quantized", "is_sparse",
    "requires_grad", "is_floating_point", "size", "dim", "numel", "element_size", "__format__",
})


class WeightStandIn(torch.Tensor):
    """A tensor with a compressed weight's shape, dtype and device and no readable values."""

    @staticmethod
    def __new__(cls, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> "WeightStandIn":
        # One element broadcast to the full shape: the right metadata for one element of memory.
        return torch.Tensor._make_subclass(cls, torch.empty((), dtype=dtype, device=device).expand(shape))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property: its descriptor's own name
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise RuntimeError(f"{_describe(args[0] if args else None)}: a compressed weight's values were read inside "
                           f"shape_only_weights() ({name}); decode it with .compressed.dense()")

    def __repr__(self, *args, **kwargs) -> str:
        return _describe(self)


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return "WeightStandIn"
    with torch._C.DisableTorchFunctionSubclass():
        return f"WeightStandIn(shape={tuple(t.shape)}, dtype={t.dtype}, device={t.device})"


@contextlib.contextmanager
def shape_only_weights() -> Iterator[None]:
    """Within this block, ``.weight`` of a compressed module is a :class:`WeightStandIn` (no decode)."""
    depth = getattr(_ACTIVE, "depth", 0)
    _ACTIVE.depth = depth + 1
    try:
        yield
    finally:
        _ACTIVE.depth = depth


def stand_ins_active() -> bool:
    """True inside :func:`shape_only_weights` (on this thread)."""
    return getattr(_ACTIVE, "depth", 0) > 0
