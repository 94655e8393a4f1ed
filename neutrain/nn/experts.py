"""Compressed MoE expert stacks: the fused 3-D parameters of transformers 5's ``*Experts`` modules.

transformers 5 stores a layer's experts as 3-D parameters (``gate_up_proj``:
experts x 2*intermediate x hidden, ``down_proj``: experts x hidden x intermediate)
and indexes them per expert inside ``forward`` (or hands them whole to a grouped
matrix product). Each stack is kept as one :class:`CompressedWeight`, whole, so
the fused optimizer updates it exactly as it updates the dense parameter (same
shape, same rule, same statistics).

The module keeps its own class and ``forward`` (so every experts implementation
works): its class is swapped for a subclass whose attribute lookup serves
``gate_up_proj``/``down_proj`` from the compressed weight. Inside a forward each
stack is decoded once, by an autograd function whose backward receives the
stack's whole gradient (autograd sums the per-expert slices first) and hands it
to the fused optimizer, which updates and re-encodes it. Outside a forward the
attribute is a fresh detached dense copy (inspection).

Memory: a decoded stack lives only through its layer's forward; the slices the
expert products save for backward are stored as references and re-decoded in
that layer's backward (:mod:`neutrain.nn.stack_views`), so at most one layer's
decoded stacks exist at a time, as for :class:`CompressedLinear` weights.

Example:
    >>> from transformers import MixtralConfig, AutoModelForCausalLM
    >>> from neutrain.nn import compress_model
    >>> cfg = MixtralConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    ...                     num_key_value_heads=1, vocab_size=32, num_local_experts=2)
    >>> model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    >>> _ = compress_model(model, progress=False)
    >>> experts = model.model.layers[0].mlp.experts
    >>> sorted(experts.compressed_params), tuple(experts.gate_up_proj.shape)
    (['down_proj', 'gate_up_proj'], (2, 64, 16))
"""

from __future__ import annotations

import torch

from neutrain.nn.stack_views import CACHE, stack_saving
from neutrain.nn.state import load_blobs, save_blobs
from neutrain.nn.weight import CompressedWeight

KEY_SUFFIX = "_key"


def expert_stacks(model: torch.nn.Module) -> list[tuple[str, str]]:
    """``(module name, parameter name)`` of every 3-D parameter of a transformers ``*Experts`` module."""
    found = []
    for name, module in model.named_modules():
        if not type(module).__name__.endswith("Experts") or isinstance(module, CompressedExpertsMixin):
            continue
        for pname, param in module.named_parameters(recurse=False):
            if param.dim() == 3 and param.is_floating_point():
                found.append((name, pname))
    return found


class _DecodeStack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, key, weight: CompressedWeight):
        ctx.weight = weight
        # A fresh tensor, not a shared decode buffer: the expert products save slices of it for backward.
        return weight.dense().to(weight.compute_dtype)

    @staticmethod
    def backward(ctx, grad):
        CACHE.drop(ctx.weight)  # every slice's backward has run: free the re-decoded stack before the update
        if ctx.needs_input_grad[0]:
            ctx.weight.apply_grad(grad)
        return None, None


class CompressedExpertsMixin:
    """Mixed into an experts module's class by :func:`compress_expert_stack`; see the module docstring."""

    compressed_params: dict

    def __getattr__(self, name: str):
        params = self.__dict__.get("compressed_params")
        if params is not None and name in params:
            decoded = self.__dict__.get("_decoded")
            if decoded is None:  # outside forward: a detached dense copy
                return params[name].dense().to(params[name].compute_dtype)
            if name not in decoded:
                decoded[name] = _DecodeStack.apply(params[name].key, params[name])
            return decoded[name]
        return super().__getattr__(name)

    def forward(self, *args, **kwargs):
        decoded = self.__dict__["_decoded"] = {}
        try:
            with stack_saving(self, decoded):
                return super().forward(*args, **kwargs)
        finally:
            decoded.clear()  # torch keeps the pack hook (which sees this dict) with every tensor it saved
            self.__dict__["_decoded"] = None

    def bind_fused_optimizer(self, optimizer) -> list[torch.Tensor]:
        """Called by ``FusedOptimizer.bind``; returns the keys this module feeds."""
        for weight in self.compressed_params.values():
            weight.optimizer = optimizer
        return [weight.key for weight in self.compressed_params.values()]

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, weight in self.compressed_params.items():
            destination.pop(prefix + name + KEY_SUFFIX, None)
            save_blobs(weight, destination, f"{prefix}{name}.")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        for name, weight in self.compressed_params.items():
            key_name, blob_prefix = prefix + name + KEY_SUFFIX, f"{prefix}{name}."
            if key_name in missing_keys:
                missing_keys.remove(key_name)
            unexpected_keys[:] = [k for k in unexpected_keys if not k.startswith(blob_prefix)]
            load_blobs(weight, state_dict, blob_prefix, missing_keys, error_msgs)


_CLASSES: dict[type, type] = {}


def _compressed_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Compressed{cls.__name__}", (CompressedExpertsMixin, cls), {"__module__": __name__})
    return _CLASSES[cls]


def compress_expert_stack(module: torch.nn.Module, pname: str, weight: CompressedWeight) -> None:
    """Replace ``module.<pname>`` (a 3-D expert parameter) by ``weight``, in place.

    The dense parameter is dropped; ``<pname>_key`` becomes the parameter the optimizer sees.
    """
    if not isinstance(module, CompressedExpertsMixin):
        module.__class__ = _compressed_class(type(module))
        module.__dict__["compressed_params"] = {}
        module.__dict__["_decoded"] = None
    weight.large = True  # optimizer reads go to the large decode buffer, freed after each update
    module.compressed_params[pname] = weight
    # The key takes the dense parameter's place: parameter order (optimizer state indices, rounding
    # seeds) is then the dense model's, whatever order the stacks were compressed in.
    module._parameters = {(pname + KEY_SUFFIX if name == pname else name): (weight.key if name == pname else p)
                          for name, p in module._parameters.items()}
