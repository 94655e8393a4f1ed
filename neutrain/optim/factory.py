"""Build a bound fused optimizer from a model and recipe-style hyperparameters.

The trainer's single entry point: it groups parameters (no weight decay for
vectors such as norms and biases, as Hugging Face's Trainer does), picks the
registered optimizer by name (:mod:`neutrain.optim.registry`) and binds it to the model's backward.
"""

from __future__ import annotations

import torch

from neutrain.optim.fused import FusedOptimizer
from neutrain.optim.registry import optimizer_spec
from neutrain.optim.weight_io import COMPRESSED_KEY_ATTR


def fused_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Trainable parameters split into a decayed group (matrices, compressed weights) and a non-decayed one."""
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        is_matrix = getattr(param, COMPRESSED_KEY_ATTR, False) or param.dim() >= 2
        (decay if is_matrix else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def build_fused_optimizer(
    model: torch.nn.Module, name: str, lr: float, weight_decay: float = 0.0, **options
) -> FusedOptimizer:
    """Create the fused optimizer ``name`` over ``model`` and bind it (hooks registered).

    Args:
        model: the model (dense, compressed by ``neutrain.nn.compress_model``, or mixed).
        name: a registered fused optimizer (:func:`~neutrain.optim.registry.optimizer_specs`): ``"lomo"``,
            ``"adalomo"``, ``"adamw-in-backward"`` and any other registered.
        lr: learning rate (schedulers change ``param_groups[i]["lr"]`` live).
        weight_decay: for matrices; vectors get none.
        **options: rule hyperparameters (``betas``, ``eps``, ...) and fused options
            (``clip_mode``, ``max_grad_norm``, ``stochastic_rounding``, ``seed``,
            ``gradient_accumulation_steps``, ``chunk_numel``, ``sharding``: the
            :class:`~neutrain.optim.sharding.Sharding` a sharded run injects, e.g.
            ``neutrain.distributed.shards.PARAMETER_SHARDS`` for FSDP2 and ZeRO-3).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        >>> opt = build_fused_optimizer(model, "adalomo", lr=1e-3, weight_decay=0.1,
        ...                             clip_mode="global_stale", max_grad_norm=1.0)
        >>> [g["weight_decay"] for g in opt.param_groups], len(opt.hooks.handles)
        ([0.1, 0.0], 4)
    """
    factory = optimizer_spec(name).resolve()
    return factory(fused_param_groups(model, weight_decay), lr=lr, **options).bind(model)
