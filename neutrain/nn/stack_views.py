"""Decoded expert stacks are not kept for backward: saved slices of them are re-decoded there.

An experts module's forward indexes its decoded 3-D stacks per expert, and the
expert products save those slices for backward, which would keep every layer's
decoded experts alive from forward to backward (as much memory as dense
experts). Inside an experts forward, :func:`stack_saving` installs
``saved_tensors_hooks`` that store such a slice as a small :class:`_StackView`
(which stack, which version, size/stride/offset) instead; in backward the stack is
decoded again (once per layer: :data:`CACHE` keeps the current layer's stacks, at
most two, and empties at the end of backward) and the slice is rebuilt with
``as_strided``, bit-identical to the one forward used.

Not installed when grad is off (nothing is saved) or when outer saved-tensor
hooks are active: activation checkpointing already drops and recomputes
everything the layer saves, decoded stacks included.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from neutrain import compat
from neutrain.compat.autograd import in_backward


@dataclasses.dataclass(frozen=True)
class _StackView:
    owner: int  # id() of the experts module: the layer
    weight: object  # the CompressedWeight
    version: int
    size: tuple
    stride: tuple
    offset: int


class _Cache:
    """The decoded stacks of the layer backward is in (a new layer evicts the previous one's)."""

    def __init__(self):
        self.owner: int | None = None
        self.stacks: dict[int, tuple[int, torch.Tensor]] = {}  # id(weight) -> (version, decoded)
        self.decodes = 0  # full re-decodes run (lets tests check one per stack and backward)
        self._queued = False

    def get(self, view: _StackView) -> torch.Tensor:
        if self.owner != view.owner:
            self.owner, self.stacks = view.owner, {}
        weight = view.weight
        entry = self.stacks.get(id(weight))
        if entry is None or entry[0] != view.version:
            if weight.version != view.version:
                raise RuntimeError(f"{weight.name}: updated between forward and backward; cannot rebuild "
                                   "the slices backward needs")
            entry = self.stacks[id(weight)] = (view.version, weight.dense().to(weight.compute_dtype))
            self.decodes += 1
        if not self._queued and in_backward():
            self._queued = True  # empty at the end of this backward, whatever happens in between
            torch.autograd.Variable._execution_engine.queue_callback(self.clear)
        return entry[1]

    def drop(self, weight) -> None:
        """Free ``weight``'s decoded stack: its gradient is complete, no slice of it is unpacked any more."""
        self.stacks.pop(id(weight), None)

    def clear(self) -> None:
        self.owner, self.stacks, self._queued = None, {}, False


CACHE = _Cache()


@contextlib.contextmanager
def stack_saving(module, decoded: dict[str, torch.Tensor]):
    """Within an experts forward: save views of the ``decoded`` stacks as re-decodable references."""
    if not torch.is_grad_enabled() or compat.saved_tensor_hooks_active():
        yield
        return
    owner = id(module)
    params = module.compressed_params

    def pack(t: torch.Tensor):
        if decoded and isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta:
            ptr = t.untyped_storage().data_ptr()
            for name, stack in decoded.items():
                if stack.untyped_storage().data_ptr() == ptr:
                    weight = params[name]
                    return _StackView(owner, weight, weight.version, tuple(t.size()), tuple(t.stride()),
                                      t.storage_offset())
        return t

    def unpack(packed):
        if isinstance(packed, _StackView):
            return CACHE.get(packed).as_strided(packed.size, packed.stride, packed.offset)
        return packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
