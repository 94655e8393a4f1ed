"""Layer groups: a decoder layer's compressed matrices decoded together and re-encoded together.

Why: at a small batch a training step's device work per weight is short, and the host's work per weight set
the pace. Measured on an H200 (Llama-3-8B, batch 1 x 1,024 tokens, ``benchmarks/memory/step_timeline.py``): the
compressed step took 565 ms for 220 ms of device work, the dense one 330 ms for 157 ms; each matrix was decoded
from Python two or three times a step (forward, checkpoint recompute, backward: 612 decodes, about 95 us of host
time each through the decode buffers) and re-encoded in three launches (about 106 us).

A group decodes all of a layer's matrices into a layer-sized buffer, in one grouped launch per tile geometry
(:func:`neutrain.compress.decode_many`). The forward, the recompute and the backward of the layer then
find their weights there: a step decodes each layer twice (forward, recompute) and backward decodes nothing. The
fused update writes each matrix in place in the buffer (it updates what ``read`` returned); the re-encode of the
layer waits until every trainable matrix of it is updated and runs as one grouped encode
(:func:`neutrain.compress.encode_many`).

Until that encode, the buffer holds the only current copy of the updated matrices. So nothing may drop it
unencoded: taking the buffer for another layer, releasing it, and any read of a member's compressed tensor
(``CompressedWeight.ct``: saving, export, another decode path) encode the pending members first.

Memory: the group buffer is the large decode slot's memory (:meth:`DecodeBuffers.shared_large`), lent to the
layers while no vocabulary matrix is decoded (the loss and the embedding's update take it back: the groups encode
what is pending and let go first), so grouping replaces the two layer slots and adds nothing. Two separate
layer buffers, freed around the vocabulary matrix's decode, measured worse on an H200 (Llama-3-8B, batch 1):
12.6 GiB reserved against 12.11 for 11.8 allocated, the freed layer buffers' pages unusable for the 1 GiB matrix.
One buffer is enough: every use of a layer's weights is enqueued on one stream before the next layer's decode
overwrites them, and nothing decodes ahead on another stream. :func:`form_groups` forms groups by default where
a layer fits in the vocabulary matrix's slot (Llama-3-8B: 0.41 GiB against 0.98), on a GPU, in a model none of whose layers
live in host memory. ``NEUTRAIN_LAYER_GROUPS=1`` forms them regardless (tests of
small models), ``0`` never. Weights held in host memory (``memory.offload_weights``) and kept decodes (the CPU's
default) are never grouped: their paths are per weight.
"""

from __future__ import annotations

import copy
import weakref

import torch

from neutrain.config.knobs import knob
from neutrain.nn.buffers import DECODE_BUFFERS

ALIGN = 128
"""Member offsets in a group buffer are multiples of 128 elements (256 bytes): aligned loads and stores for the
grouped decode, whose lanes store four bf16 values as one 8-byte word only at 8-byte aligned outputs."""


def _setting() -> str:
    """``NEUTRAIN_LAYER_GROUPS`` (:mod:`neutrain.config.knobs`) as ``auto``, ``on`` or ``off``."""
    return {"auto": "auto", "1": "on", "0": "off"}[knob("NEUTRAIN_LAYER_GROUPS")]


class _Buffer:
    """The layer-sized buffer of a (device, dtype): its tensor (None while released) and holder."""

    __slots__ = ("tensor", "holder")

    def __init__(self):
        self.tensor: torch.Tensor | None = None
        self.holder: WeightGroup | None = None


class LayerGroups:
    """The process-wide group buffer per (device, dtype), and which group it holds."""

    def __init__(self):
        self._buffers: dict[tuple, _Buffer] = {}
        self._numel: dict[tuple, int] = {}  # the largest group of each key: the buffers' size
        self._pending: weakref.WeakSet = weakref.WeakSet()
        DECODE_BUFFERS.large_listeners.append(self.release)  # the buffers are the large slot's memory
        self.decodes = 0  # grouped decodes run (one per layer and pass)
        self.encodes = 0  # grouped encodes run (one per layer and step)

    def __deepcopy__(self, memo):
        return self  # process-wide: the buffers are the large decode slot's memory, of which there is one

    def register(self, group: "WeightGroup") -> None:
        self._numel[group.key] = max(self._numel.get(group.key, 0), group.numel)

    def take(self, group: "WeightGroup") -> None:
        """Give ``group`` its key's buffer, encoding and dropping the buffer's holder first."""
        buf = self._buffers.get(group.key)
        if buf is None:
            buf = self._buffers[group.key] = _Buffer()
        if buf.holder is not None:
            buf.holder._drop()
        if buf.tensor is None:
            device, dtype = group.key
            tensor = DECODE_BUFFERS.shared_large(device, dtype, self._numel[group.key])  # calls release() first
            buf.tensor = tensor
        buf.holder = group
        group._bind(buf)

    def release(self, device: torch.device | None = None) -> None:
        """Encode what is pending and let go of the buffers (of ``device``, or all): a vocabulary matrix is about
        to be decoded into their memory."""
        for key, buf in self._buffers.items():
            if device is not None and key[0] != device:
                continue
            if buf.holder is not None:
                buf.holder._drop()
            buf.tensor = None

    def flush(self) -> None:
        """Encode every group's pending members now."""
        for group in list(self._pending):
            group.flush()

    def nbytes(self) -> int:
        return sum(b.tensor.numel() * b.tensor.element_size() for b in self._buffers.values() if b.tensor is not None)


LAYER_GROUPS = LayerGroups()
"""The process-wide group buffers."""


class WeightGroup:
    """A layer's compressed weights, decoded and re-encoded together (see the module docstring).

    Example:
        >>> from neutrain.compress import compress
        >>> from neutrain.nn import CompressedWeight
        >>> ws = [CompressedWeight(compress(torch.randn(8, 4).bfloat16()), name=n) for n in "ab"]
        >>> group = WeightGroup(ws)
        >>> torch.equal(ws[1].decode(), ws[1].ct.decompress()), LAYER_GROUPS.decodes > 0
        (True, True)
    """

    def __init__(self, members, registry: LayerGroups = LAYER_GROUPS, native: bool = True):
        members = list(members)
        # Whether the layer's products may run natively (:meth:`leaf`): not where the layer also decodes a
        # large weight (a mixture of experts' stacks), whose decode takes this buffer's memory between the
        # layer's recompute and its products' backward.
        self.native = native
        first = members[0]
        self.key = (first.device, first.dtype)
        if any((m.device, m.dtype) != self.key for m in members):
            raise ValueError("a weight group's members share one device and dtype")
        self.registry = registry
        self.members = members
        self.offsets, total = [], 0
        for m in members:
            self.offsets.append(total)
            total += -(-m.numel // ALIGN) * ALIGN
        self.numel = total
        self.versions: list[int | None] = [None] * len(members)  # what the buffer holds of each member
        self.pending = [False] * len(members)  # updated in the buffer, not yet encoded
        self.buffer: _Buffer | None = None
        self.views: list[torch.Tensor] | None = None
        self.leaves: list[torch.Tensor | None] = [None] * len(members)  # see leaf()
        for i, m in enumerate(members):
            m.group, m.group_index = self, i
        registry.register(self)

    def __deepcopy__(self, memo):
        """A copy of the model gets its own group over the copied members, holding no buffer: the buffers are the
        registry's (shared, not copied: a copied registry would not hear the vocabulary decode take them back)."""
        new = WeightGroup.__new__(WeightGroup)
        memo[id(self)] = new
        n = len(self.members)
        new.native, new.key, new.registry = self.native, self.key, self.registry
        new.offsets, new.numel = list(self.offsets), self.numel
        new.versions, new.pending, new.leaves = [None] * n, [False] * n, [None] * n
        new.buffer, new.views = None, None
        new.members = [copy.deepcopy(m, memo) for m in self.members]
        return new

    def _bind(self, buf: _Buffer) -> None:
        self.buffer = buf
        flat = buf.tensor
        self.views = [flat[o:o + m.numel].view(m.shape) for o, m in zip(self.offsets, self.members)]
        self.versions = [None] * len(self.members)

    def _drop(self) -> None:
        """Lose the buffer (it goes to another group or is freed): pending members are encoded first."""
        if any(self.pending):
            self.flush()
        if self.buffer is not None:
            self.buffer.holder = None
        self.buffer, self.views = None, None
        self.versions = [None] * len(self.members)

    def view(self, weight) -> torch.Tensor:
        """``weight`` decoded, in this group's buffer (all stale members decoded in grouped launches)."""
        i = weight.group_index
        if self.buffer is not None and self.versions[i] == weight.version:
            return self.views[i]
        if self.buffer is None:
            self.registry.take(self)
        self._decode_stale()
        return self.views[i]

    def leaf(self, weight) -> torch.Tensor:
        """``weight`` decoded in this group's buffer, as a tensor the native ``F.linear`` can take: its own autograd
        leaf over the view's memory, whose gradient goes to the fused update (the same hook dense LOMO uses).

        Why: a custom autograd function per matrix costs two Python nodes in forward and one in backward (about
        50 us of host time a matrix on an H200 host), and at a small batch the host sets the step's pace; the
        native product runs in C++ and saves its inputs as dense's does. Valid only where nothing the forward
        saves outlives the layer's backward (:func:`neutrain.compat.autograd.in_checkpointed_region`): the
        buffer holds another layer once this one's backward is done.

        The leaf has a version counter of its own (``set_`` over the storage, not a view): the in-place update
        of a sibling member, written through its view, must not look like a change to this member's saved weight.
        """
        view = self.view(weight)
        i = weight.group_index
        leaf = self.leaves[i]
        if leaf is None or leaf.data_ptr() != view.data_ptr() or leaf.requires_grad != weight.trainable:
            leaf = torch.empty(0, dtype=view.dtype, device=view.device)
            leaf.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
            if weight.trainable:
                leaf.requires_grad_(True)
                leaf.register_post_accumulate_grad_hook(_GradToUpdate(weight))
            self.leaves[i] = leaf
        return leaf

    def _decode_stale(self) -> None:
        from neutrain.compress import decode_many  # lazy: compress's package init, grouped decodes only

        stale = [i for i, m in enumerate(self.members) if self.versions[i] != m.version]
        if not stale:
            return
        for i in stale:
            m = self.members[i]
            m._resident()
            m.decodes += 1
        decode_many([self.members[i]._ct for i in stale], [self.views[i] for i in stale])
        for i in stale:
            self.versions[i] = self.members[i].version
        self.registry.decodes += 1

    def took(self, weight, tensor: torch.Tensor) -> bool:
        """The update of ``weight`` was written in place into its view: defer its encode (True), or False when
        ``tensor`` is not that view (the caller then encodes at once)."""
        i = weight.group_index
        if self.buffer is None or self.versions[i] != weight.version or tensor.data_ptr() != self.views[i].data_ptr():
            return False
        weight.version += 1
        self.versions[i] = weight.version
        self.pending[i] = True
        self.registry._pending.add(self)
        # Counted now, not at formation: a run may freeze or unfreeze weights after the build (LoRA).
        if sum(self.pending) >= sum(m.trainable for m in self.members):
            self.flush()
        return True

    def flush(self) -> None:
        """Encode the pending members from the buffer (grouped launches, no host synchronisation)."""
        from neutrain.compress import encode_many  # lazy: compress's package init, grouped encodes only

        todo = [i for i, p in enumerate(self.pending) if p]
        self.pending = [False] * len(self.members)
        self.registry._pending.discard(self)
        if todo:
            encode_many([self.members[i]._ct for i in todo], [self.views[i] for i in todo])
            self.registry.encodes += 1

    def dissolve(self) -> None:
        """Ungroup the members (pending ones encoded first): each decodes and encodes on its own from now on."""
        self._drop()
        for m in self.members:
            m.group = None

    def forget(self, weight) -> None:
        """``weight`` got new contents from elsewhere (a checkpoint): the buffer's copy is stale, not pending."""
        self.versions[weight.group_index] = None
        self.pending[weight.group_index] = False


class _GradToUpdate:
    """A member leaf's post-accumulate hook: the gradient goes to the fused update, never stays in ``.grad``."""

    __slots__ = ("weight",)

    def __init__(self, weight):
        self.weight = weight

    def __call__(self, leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        if grad is not None:
            with torch.no_grad():
                self.weight.apply_grad(grad)


def _layer_lists(model: torch.nn.Module):
    """The members of every ``ModuleList`` (a decoder's layers), as module lists."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            yield list(module)


def form_groups(model: torch.nn.Module, weights_of, keeps) -> int:
    """Group each decoder layer's compressed weights (see the module docstring for when); return the count.

    ``weights_of(module)``: the module's distinct compressed weights; ``keeps(device)``: whether decodes on
    ``device`` are kept in buffers of their own (then nothing there is grouped).
    """
    setting = _setting()
    if setting == "off":
        return 0
    if any(w.home is not None for w in weights_of(model)):
        # Layers in host memory decode per weight from their payloads, through the layer slots; grouping the
        # rest would hold the vocabulary slot all step, which the fit did not count on (neutrain.memory.planner).
        return 0
    layers = []
    for modules in _layer_lists(model):
        for layer in modules:
            weights = weights_of(layer)
            members = [w for w in weights if not w.large]
            if len(members) < 2 or any(w.group is not None for w in members):
                continue
            if any(w.home is not None or w.device.type != "cuda" and setting != "on" for w in members):
                continue
            if keeps(members[0].device) or len({(w.device, w.dtype) for w in members}) > 1:
                continue
            if not all(w.ct.layout.lossless for w in members):
                continue
            layers.append((members, len(members) == len(weights)))
    if not layers:
        return 0
    if setting == "auto":
        large = [w.numel for w in weights_of(model) if w.large]
        largest_layer = max(sum(-(-w.numel // ALIGN) * ALIGN for w in members) for members, _ in layers)
        if not large or largest_layer > max(large):
            return 0
    for members, native in layers:
        WeightGroup(members, native=native)
    return len(layers)
