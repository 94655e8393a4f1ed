"""Fused projections for batch-1 decode: one GEMV for Q/K/V and one for gate/up per layer.

At batch 1 a decoder layer's step is a chain of small kernels, each paying its launch-to-completion
latency even inside a CUDA graph (``benchmarks/notes_speculative.md``): Llama's attention runs three
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

Only plain ``nn.Linear`` members of one dtype and device, without hooks, are fused (Llama, Mistral,
Qwen2/3 and other models with these attribute names; GQA's smaller K/V blocks included). Compressed
(NeuZip), LoRA-wrapped or offloaded projections are left as they are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

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
        """Whether every member's parameters still sit at their offsets of the fused tensors (host metadata only)."""
        for member, (start, _) in zip(self.members, self.bounds):
            weight = member.weight
            if weight.device != self.weight.device or weight.dtype != self.weight.dtype:
                return False
            row = self.weight.stride(0) * self.weight.element_size()
            if weight.data_ptr() != self.weight.data_ptr() + start * row:
                return False
            if (member.bias is None) != (self.bias is None) or (
                    self.bias is not None and member.bias.data_ptr() != self.bias.data_ptr() + start * self.bias.element_size()):
                return False
        return True

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``index``'s output: its row block of the group's one GEMV on ``x`` (computed at the first call)."""
        if self._input is not x or index in self._served:  # a new input: one GEMV for the whole group
            self._input, self._output, self._served = x, nn.functional.linear(x, self.weight, self.bias), set()
        self._served.add(index)
        start, end = self.bounds[index]
        out = self._output[..., start:end]
        if len(self._served) == len(self.members):  # every member has its view: hold no activation
            self._input = self._output = None
        return out


class FusedMemberLinear(nn.Linear):
    """An ``nn.Linear`` whose weight is a row block of its group's fused matrix (see the module docstring).

    Inside :func:`projection_fusion` without autograd it returns its block of the group's one GEMV;
    elsewhere it is the plain ``nn.Linear`` it was.
    """

    _neutrain_group: _Group
    _neutrain_index: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self._neutrain_group
        if group.active and not (torch.is_grad_enabled() and self.weight.requires_grad) and group.intact():
            return group.output(self._neutrain_index, x)
        return super().forward(x)


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


def _fuse_group(members: list[nn.Linear]) -> None:
    bounds, start = [], 0
    for m in members:
        bounds.append((start, start + m.out_features))
        start += m.out_features
    with torch.no_grad():
        weight = torch.cat([m.weight.detach() for m in members], 0)
        bias = torch.cat([m.bias.detach() for m in members]) if members[0].bias is not None else None
        for m, (a, b) in zip(members, bounds):
            m.weight.data = weight[a:b]  # same Parameter, now a row block: the old storage is freed
            if bias is not None:
                m.bias.data = bias[a:b]
    group = _Group(members, weight, bias, bounds)
    for index, m in enumerate(members):
        m.__class__ = FusedMemberLinear
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
    count = 0
    for module in model.modules():
        for names in GROUPS:
            members = [getattr(module, name, None) for name in names]
            if any(m is None for m in members):
                continue
            fused = [isinstance(m, FusedMemberLinear) for m in members]
            if all(fused) and len({id(m._neutrain_group) for m in members}) == 1 and members[0]._neutrain_group.intact():
                count += 1
                continue
            for m, was in zip(members, fused):  # re-allocated since (``model.to``): fuse the current weights anew
                if was:
                    _make_plain(m)
            if _fusable(members):
                _fuse_group(members)
                count += 1
    model._neutrain_fused_groups = _groups(model)  # what projection_fusion toggles, found once
    return count


def _groups(model: nn.Module) -> list[_Group]:
    seen: dict[int, _Group] = {}
    for m in model.modules():
        if isinstance(m, FusedMemberLinear):
            seen.setdefault(id(m._neutrain_group), m._neutrain_group)
    return list(seen.values())


@contextlib.contextmanager
def projection_fusion(model: nn.Module) -> Iterator[None]:
    """Within this context the fused groups of ``model`` run one GEMV each (a no-op for a model without any).

    The decode engine wraps its model calls in this; a CUDA graph captured inside keeps the fused GEMVs.
    """
    groups = getattr(model, "_neutrain_fused_groups", None)
    groups = _groups(model) if groups is None else groups
    previous = [g.active for g in groups]
    for g in groups:
        g.active = True
    try:
        yield
    finally:
        for g, was in zip(groups, previous):
            g.active = was


def unfuse_projections(model: nn.Module) -> int:
    """Give every fused member its own weight storage again and make it a plain ``nn.Linear``; returns
    how many groups were undone (their fused matrices are freed once nothing else holds them)."""
    groups = _groups(model)
    model.__dict__.pop("_neutrain_fused_groups", None)
    with torch.no_grad():
        for g in groups:
            for m in g.members:
                m.weight.data = m.weight.detach().clone()
                if m.bias is not None:
                    m.bias.data = m.bias.detach().clone()
                _make_plain(m)
    return len(groups)


def _make_plain(member: FusedMemberLinear) -> None:
    member.__class__ = nn.Linear
    del member._neutrain_group, member._neutrain_index
