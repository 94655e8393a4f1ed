"""LOMO: plain SGD applied inside backward (Lv et al., arXiv 2306.09782).

Per tensor: ``w <- w * (1 - lr * wd) - lr * g`` in fp32, as ``lomo_optim.Lomo``
does (decoupled decay first, then the step), written back to bf16 with
stochastic rounding. No optimizer state at all: the only memory cost of the
update is one row chunk of fp32 temporaries.
"""

from __future__ import annotations

from typing import Iterable

import torch

from neutrain.optim.fused import FusedOptimizer
from neutrain.optim.rule import scaled


class LOMO(FusedOptimizer):
    """Fused SGD (LOMO).

    Args:
        params: parameters or groups (``model.parameters()``).
        lr: learning rate (per group, read live, so schedulers apply).
        weight_decay: decoupled weight decay, ``w *= 1 - lr * weight_decay``.
        **kwargs: clipping, rounding and chunking options of
            :class:`~neutrain.optim.fused.FusedOptimizer`.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = LOMO(model.parameters(), lr=1e-2).bind(model)
        >>> model(torch.randn(3, 4)).sum().backward()   # weights updated here
        >>> opt.step(); model.weight.grad is None
        True
    """

    elementwise = True

    def __init__(self, params: Iterable, lr: float = 1e-3, weight_decay: float = 0.0, **kwargs):
        if lr < 0:
            raise ValueError(f"invalid learning rate {lr}")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay), **kwargs)

    def _rule_chunk(self, p32, grad, coef, state, group, rows, ok, scalars) -> torch.Tensor:
        lr, wd = group["lr"], group["weight_decay"]
        if wd:
            p32.mul_(1.0 - lr * wd)
        # Unclipped, the bf16 gradient is upcast inside the add: no fp32 copy of it is made.
        return p32.add_(grad if coef is None else scaled(grad, coef), alpha=-lr)
