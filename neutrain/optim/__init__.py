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

from neutrain.optim.adalomo import AdaLomo
from neutrain.optim.adamw import AdamWInBackward
from neutrain.optim.clipping import ClipMode
from neutrain.optim.fused import FusedOptimizer
from neutrain.optim.factory import OPTIMIZERS, build_fused_optimizer, fused_param_groups
from neutrain.optim.lomo import LOMO
from neutrain.optim.rounding import stochastic_round_to_bf16
from neutrain.optim.sharding import Sharding
from neutrain.optim.weight_io import COMPRESSED_KEY_ATTR, DenseWeightIO, WeightIO

__all__ = [
    "AdaLomo",
    "AdamWInBackward",
    "ClipMode",
    "COMPRESSED_KEY_ATTR",
    "DenseWeightIO",
    "FusedOptimizer",
    "LOMO",
    "OPTIMIZERS",
    "Sharding",
    "WeightIO",
    "build_fused_optimizer",
    "fused_param_groups",
    "stochastic_round_to_bf16",
]
