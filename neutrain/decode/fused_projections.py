"""Fused projections for batch-1 decode: one GEMV for Q/K/V and one for gate/up per layer.

At batch 1 a decoder layer's step is a chain of small kernels, each paying its launch-to-completion
latency even inside a CUDA graph (``benchmarks/decode/NOTES.md``): Llama's attention runs three
GEMVs on the same input (``q_proj``, ``k_proj``, ``v_proj``) and its MLP two (``gate_proj``,
``up_proj``). :func:`fuse_projections` concatenates each group's weights into ONE matrix, once, and
:func:`projection_fusion` makes the first member called inside it run the group's single GEMV;
the other members return their row block of that output as a view.

Memory: the fused matrix REPLACES the members' weights. Each member's ``weight`` (and ``bias``)
Parameter keeps its identity, name, shape and dtype, but its ``.data`` becomes a row block of the
fused matrix, so the old storages are freed and the model holds each weight once. Therefore

* training is unchanged: outside :func:`projection_fusion` (or with autograd recording) a member
  is a plain ``nn.Linear`` on its own weight view; an optimizer's in-place update of that view
  updates the fused matrix too, so a decode engine on the model sees every step;
* ``state_dict`` keys, shapes and values are unchanged (the tensors are disjoint views of one
  storage; ``save_pretrained`` writes them as separate tensors); :func:`unfuse_projections` gives
  every member its own storage again;
* an operation that re-allocates a member's weight (``model.to(dtype)``, ``load_state_dict(...,
  assign=True)``) breaks the sharing: the group notices (its members no longer sit at their
  offsets of the fused matrix) and falls back to the separate GEMVs, which stay correct.

Plain ``nn.Linear`` members of one dtype and device, without hooks, are fused (Llama, Mistral,
Qwen2/3 and other models with these attribute names; GQA's smaller K/V blocks included). LoRA-wrapped
projections are left as they are.

Compressed (NeuZip) members, on the GPU or streamed from host memory, fuse too, for exactness: a GPU's
GEMM kernel, and with it the order in which a dot product is summed, depends on the matrix's shape, so
the dense model's one ``[q; k; v]`` product and three separate products from the decoded weights
differ in the last bits, and a greedy decode follows a near-tie differently (Llama-3-8B, one H200:
``neutrain generate`` of the same export gave another 16th token at a 14.5 GiB budget than without
one). A compressed group decodes each member's weight into its row block of one scratch matrix,
shared by every group of the model, and runs the group's one product on it: the same call on the same
bits as the dense model's fused group. The scratch is one matrix of the largest group (224 MiB for
Llama-3-8B's gate/up); nothing else is held.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from neutrain.nn import CompressedLinear
from neutrain.nn.prefetch import PREFETCHER

#: Attribute names of the projections that read the same input, per group.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Group:
    """The fused weight (and bias) of one group and the output its members share for one input."""

    def __init__(self, members: list[nn.Linear], weight: torch.Tensor, bias: torch.Tensor | None,
                 bounds: list[tuple[int, int]]):
        self.members, self.weight, self.bias, self.bounds = members, weight, bias, bounds
        self.active = False
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._served: set[int] = set()

    def intact(self) -> bool:
        """Whether every member's weight and bias still sit at their offsets of the fused tensors (host metadata only)."""
        return all(self._weight_intact(member, start, end) and self._bias_intact(member, start)
                   for member, (start, end) in zip(self.members, self.bounds))

    def _weight_intact(self, member, start: int, end: int) -> bool:
        weight = member.weight
        row = self.weight.stride(0) * self.weight.element_size()
        return weight.device == self.weight.device and weight.dtype == self.weight.dtype and \
            weight.data_ptr() == self.weight.data_ptr() + start * row

    def _bias_intact(self, member, start: int) -> bool:
        if self.bias is None:
            return member.bias is None
        return member.bias is not None and \
            member.bias.data_ptr() == self.bias.data_ptr() + start * self.bias.element_size()

    def fused_weight(self) -> torch.Tensor:
        """The group's ``[sum of out_features, in_features]`` matrix."""
        return self.weight

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The group's one product on ``x``: every member's output side by side."""
        return nn.functional.linear(x, self.fused_weight(), self.bias)

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``index``'s output: its row block of the group's one GEMV on ``x`` (computed at the first call)."""
        if self._input is not x or index in self._served:  # a new input: one GEMV for the whole group
            self._input, self._output, self._served = x, self.product(x), set()
        self._served.add(index)
        start, end = self.bounds[index]
        out = self._output[..., start:end]
        if len(self._served) == len(self.members):  # every member has its view: hold no activation
            self._input = self._output = None
        return out


def _intact(group: _Group) -> bool:
    """``group.intact()``, except while torch.compile traces: data pointers cannot be traced, and the caller of
    compiled layers (:class:`~neutrain.decode.compiled_layers.CompiledLayers`) checks every group before the call."""
    return torch.compiler.is_compiling() or group.intact()


class FusedMemberLinear(nn.Linear):
    """An ``nn.Linear`` whose weight is a row block of its group's fused matrix (see the module docstring).

    Inside :func:`projection_fusion` without autograd it returns its block of the group's one GEMV;
    elsewhere it is the plain ``nn.Linear`` it was.
    """

    _neutrain_group: _Group
    _neutrain_index: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self._neutrain_group
        if group.active and not (torch.is_grad_enabled() and self.weight.requires_grad) and _intact(group):
            return group.output(self._neutrain_index, x)
        return super().forward(x)


class _CompressedGroup(_Group):
    """A group of compressed members: each weight decoded into its row block of the shared ``scratch``."""

    def __init__(self, members: list[CompressedLinear], bias: torch.Tensor | None, bounds: list[tuple[int, int]],
                 scratch: torch.Tensor):
        super().__init__(members, scratch, bias, bounds)
        self.rows, self.cols = bounds[-1][1], members[0].in_features
        self.zgemv = None  # the group's matrix in the zgemv layout, when attached (neutrain.decode.zgemv)

    def _weight_intact(self, member, start: int, end: int) -> bool:
        """Whether the member still holds a weight this group can decode into its rows of the scratch."""
        weight = member.compressed
        return weight.dtype == self.weight.dtype and weight.device == self.weight.device and \
            weight.compute_dtype == weight.dtype and tuple(weight.shape) == (end - start, self.cols)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if self.zgemv is not None and self.zgemv.usable(x):  # a decode step: the compressed matrix read once
            return self.zgemv(x, self.bias)
        return super().product(x)

    def fused_weight(self) -> torch.Tensor:
        fused = self.weight[: self.rows * self.cols].view(self.rows, self.cols)
        for member, (start, end) in zip(self.members, self.bounds):
            member.compressed.decode_into(fused[start:end])
            PREFETCHER.after_decode(member.compressed, False)
        return fused


class FusedCompressedLinear(CompressedLinear):
    """A :class:`~neutrain.nn.CompressedLinear` of a fused group: inside :func:`projection_fusion` without
    autograd it returns its block of the group's one product; elsewhere it is the compressed layer it was."""

    _neutrain_group: _CompressedGroup
    _neutrain_index: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self._neutrain_group
        if group.active and not torch.is_grad_enabled() and _intact(group):
            return group.output(self._neutrain_index, x)
        return super().forward(x)


def _compressed_fusable(members: list) -> bool:
    if not all(type(m) is CompressedLinear for m in members):
        return False
    if any(m._forward_hooks or m._forward_pre_hooks for m in members):
        return False
    first = members[0].compressed
    same = all(m.compressed.dtype == first.dtype and m.compressed.device == first.device
               and m.compressed.compute_dtype == m.compressed.dtype and m.in_features == members[0].in_features
               for m in members)
    return same and len({m.bias is None for m in members}) == 1 and first.device.type != "meta"


def _fusable(members: list) -> bool:
    if not all(type(m) is nn.Linear for m in members):  # subclasses (compressed, LoRA, fused already) are not ours
        return False
    if any(m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook") for m in members):
        return False
    first = members[0].weight
    same = all(m.weight.dtype == first.dtype and m.weight.device == first.device and m.in_features == members[0].in_features
               for m in members)
    biases = {m.bias is None for m in members}
    return same and len(biases) == 1 and first.device.type != "meta"


def _fuse_group(members: list, scratch: torch.Tensor | None = None) -> None:
    """Fuse ``members`` in place: plain linears into one matrix; compressed ones (``scratch`` given) to decode
    into their rows of ``scratch``. Either way their biases become row blocks of one fused bias."""
    bounds, start = [], 0
    for m in members:
        bounds.append((start, start + m.out_features))
        start += m.out_features
    with torch.no_grad():
        bias = torch.cat([m.bias.detach() for m in members]) if members[0].bias is not None else None
        weight = torch.cat([m.weight.detach() for m in members], 0) if scratch is None else None
        for m, (a, b) in zip(members, bounds):
            if weight is not None:
                m.weight.data = weight[a:b]  # same Parameter, now a row block: the old storage is freed
            if bias is not None:
                m.bias.data = bias[a:b]
    if scratch is None:
        group, cls = _Group(members, weight, bias, bounds), FusedMemberLinear
    else:
        group, cls = _CompressedGroup(members, bias, bounds, scratch), FusedCompressedLinear
    for index, m in enumerate(members):
        m.__class__ = cls
        m._neutrain_group, m._neutrain_index = group, index


def fuse_projections(model: nn.Module) -> int:
    """Fuse every module's Q/K/V and gate/up projections in place (see the module docstring); returns
    how many groups are fused now (an intact fused group counts and stays; one whose weights were
    re-allocated since, e.g. by ``model.to``, is fused again from its current weights).

    Example:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).eval()
        >>> ids = torch.tensor([[1, 2, 3]])
        >>> before = model(ids).logits
        >>> fuse_projections(model)  # 2 layers x (QKV, gate/up)
        4
        >>> with torch.no_grad(), projection_fusion(model):
        ...     after = model(ids).logits
        >>> torch.allclose(before, after, atol=1e-5), model.model.layers[0].self_attn.k_proj.weight.shape
        (True, torch.Size([8, 16]))
    """
    count, compressed = 0, []
    for module in model.modules():
        for names in GROUPS:
            members = [getattr(module, name, None) for name in names]
            if any(m is None for m in members):
                continue
            fused = [isinstance(m, (FusedMemberLinear, FusedCompressedLinear)) for m in members]
            if all(fused) and len({id(m._neutrain_group) for m in members}) == 1 and members[0]._neutrain_group.intact():
                count += 1
                continue
            for m, was in zip(members, fused):  # re-allocated since (``model.to``): fuse the current weights anew
                if was:
                    _make_plain(m)
            if _fusable(members):
                _fuse_group(members)
                count += 1
            elif _compressed_fusable(members):
                compressed.append(members)
    if compressed:  # one scratch matrix, of the largest group, for every compressed group of the model
        first = compressed[0][0].compressed
        size = max(sum(m.out_features for m in members) * members[0].in_features for members in compressed)
        scratch = torch.empty(size, dtype=first.dtype, device=first.device)
        for members in compressed:
            if members[0].compressed.dtype == first.dtype and members[0].compressed.device == first.device:
                _fuse_group(members, scratch)
                count += 1
    model._neutrain_fused_groups = _groups(model)  # what projection_fusion toggles, found once
    return count


def _groups(model: nn.Module) -> list[_Group]:
    seen: dict[int, _Group] = {}
    for m in model.modules():
        if isinstance(m, (FusedMemberLinear, FusedCompressedLinear)):
            seen.setdefault(id(m._neutrain_group), m._neutrain_group)
    return list(seen.values())


@contextlib.contextmanager
def projection_fusion(model: nn.Module) -> Iterator[None]:
    """Within this context the fused groups of ``model`` run one GEMV each (a no-op for a model without any).

    The decode engine wraps its model calls in this; a CUDA graph captured inside keeps the fused GEMVs.
    """
    groups = getattr(model, "_neutrain_fused_groups", None)
    with activated(_groups(model) if groups is None else groups):
        yield


@contextlib.contextmanager
def activated(items: list) -> Iterator[None]:
    """Set ``active`` on each of ``items`` while the context lasts, then back to what it was (nested calls too)."""
    previous = [item.active for item in items]
    for item in items:
        item.active = True
    try:
        yield
    finally:
        for item, was in zip(items, previous):
            item.active = was


def unfuse_projections(model: nn.Module) -> int:
    """Give every fused member its own weight storage again and make it a plain ``nn.Linear``; returns
    how many groups were undone (their fused matrices are freed once nothing else holds them)."""
    groups = _groups(model)
    model.__dict__.pop("_neutrain_fused_groups", None)
    with torch.no_grad():
        for g in groups:
            for m in g.members:
                if isinstance(m, FusedMemberLinear):
                    m.weight.data = m.weight.detach().clone()
                if m.bias is not None:
                    m.bias.data = m.bias.detach().clone()
                _make_plain(m)
    return len(groups)


def _make_plain(member: FusedMemberLinear | FusedCompressedLinear) -> None:
    member.__class__ = CompressedLinear if isinstance(member, FusedCompressedLinear) else nn.Linear
    del member._neutrain_group, member._neutrain_index
