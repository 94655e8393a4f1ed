"""Fused-update optimizers: each gradient is applied inside backward and freed at once.

Example:
    >>> import torch
    >>> from neutrain.optim import LOMO
    >>> model = torch.nn.Linear(8, 8)
    >>> opt = LOMO(model.parameters(), lr=1e-2, clip_mode="per_tensor", max_grad_norm=1.0).bind(model)
    >>> opt.backward(model(torch.randn(2, 8)).square().mean())   # updates happen here
    >>> opt.step()                                                 # bookkeeping: norm, counters
    >>> opt.grad_norm() > 0
    True
"""

from __future__ import annotations

import importlib

# name -> module, imported on first access (PEP 562): the registry (neutrain.optim.registry) is read by the
# recipe check and the planner, which must not import torch, and importing it runs this file first.
_LAZY = {
    "AdaLomo": "neutrain.optim.adalomo",
    "AdamWInBackward": "neutrain.optim.adamw",
    "ClipMode": "neutrain.optim.clipping",
    "COMPRESSED_KEY_ATTR": "neutrain.optim.weight_io",
    "DenseWeightIO": "neutrain.optim.weight_io",
    "FusedOptimizer": "neutrain.optim.fused",
    "LOMO": "neutrain.optim.lomo",
    "OptimizerSpec": "neutrain.optim.registry",
    "Sharding": "neutrain.optim.sharding",
    "StateCost": "neutrain.optim.registry",
    "WeightIO": "neutrain.optim.weight_io",
    "build_fused_optimizer": "neutrain.optim.factory",
    "fused_param_groups": "neutrain.optim.factory",
    "optimizer_spec": "neutrain.optim.registry",
    "optimizer_specs": "neutrain.optim.registry",
    "register_optimizer": "neutrain.optim.registry",
    "stochastic_round_to_bf16": "neutrain.optim.rounding",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'neutrain.optim' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
