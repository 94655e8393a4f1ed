"""LOMO: plain SGD applied inside backward (Lv et al., arXiv 2306.09782).

Per tensor: ``w <- w * (1 - lr * wd) - lr * g`` in fp32, as ``lomo_optim.Lomo``
does (decoupled decay first, then the step), written back to bf16 with
stochastic rounding. No optimizer state at all: the only memory cost of the
update is one row chunk of fp32 temporaries.
"""

from __future__ import annotations

from typing import Iterable

import torch

from neutrain.config.knobs import knob
from neutrain.kernels import triton_available
from neutrain.optim.fused import FusedOptimizer
from neutrain.optim.rule import scaled, weight_rows


def use_fused_kernel(weight: torch.Tensor) -> bool:
    """Whether LOMO updates ``weight`` with the one-kernel ``fused_update`` (CUDA, Triton; off with
    ``NEUTRAIN_FUSED_UPDATE=0``, the A/B switch of ``benchmarks/memory/train_memory.py``)."""
    return (weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float32) and triton_available()
            and knob("NEUTRAIN_FUSED_UPDATE"))


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
    keeps_nonfinite_elements = True  # w - lr * g is non-finite where g is; no state

    def __init__(self, params: Iterable, lr: float = 1e-3, weight_decay: float = 0.0, **kwargs):
        if lr < 0:
            raise ValueError(f"invalid learning rate {lr}")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay), **kwargs)

    def _update_rows(self, weight, grad_rows, state, group, ok, coef, generator) -> None:
        if not use_fused_kernel(weight):
            return super()._update_rows(weight, grad_rows, state, group, ok, coef, generator)
        from neutrain.kernels.fused_update import fused_update_  # lazy: Triton, CUDA path only

        # One kernel per row chunk (the streamed lm_head/embedding update hands gradient rows chunk
        # by chunk); the noise is keyed by the element's index in the whole tensor, so chunking
        # does not change the result. The generator carries the per-update seed it was given.
        seed = generator.initial_seed() if generator is not None else None
        # A compressed weight's re-encode counts code lengths here, as each value is stored: the
        # encode then reads the weight once instead of twice (neutrain.compress.counted).
        count = (self.count_into(weight) if isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16
                 else None)  # row blocks (a vocabulary matrix) count in their own re-encode
        w_rows = weight_rows(weight)
        row_numel = w_rows.shape[1]
        for rows in self._row_chunks(weight):
            grad = grad_rows(rows)
            fused_update_(w_rows[rows], grad if grad.is_contiguous() else grad.contiguous(), lr=group["lr"],
                          weight_decay=group["weight_decay"], coef=coef, ok=ok, seed=seed,
                          base=rows.start * row_numel, count=count)

    def _rule_chunk(self, p32, grad, coef, state, group, rows, ok, scalars) -> torch.Tensor:
        lr, wd = group["lr"], group["weight_decay"]
        if wd:
            p32.mul_(1.0 - lr * wd)
        # Unclipped, the bf16 gradient is upcast inside the add: no fp32 copy of it is made.
        return p32.add_(grad if coef is None else scaled(grad, coef), alpha=-lr)
