"""AdamW applied inside backward, for dense parameters.

The same arithmetic as ``torch.optim.AdamW`` (decoupled decay, bias-corrected
moments), run per tensor from a post-accumulate-grad hook as in torchtune's
optimizer-in-backward (docs/trainer.md §3). Moments are fp32 and cost 8 bytes per
parameter, so this rule suits the dense parts of a model (norms, biases, small
models); compressed weights are better served by LOMO or AdaLomo.

The step counter is a device tensor advanced only when the gradient was finite,
so a skipped update does not shift the bias correction and needs no host sync.
"""

from __future__ import annotations

from typing import Iterable

import torch

from neutrain.optim.clipping import as_rows
from neutrain.optim.fused import FusedOptimizer
from neutrain.optim.rule import scaled


class AdamWInBackward(FusedOptimizer):
    """Fused AdamW.

    Args:
        params: parameters or groups.
        lr: learning rate.
        betas: ``(beta1, beta2)`` moment decay rates.
        eps: denominator epsilon.
        weight_decay: decoupled weight decay (torch's AdamW default 0.01).
        **kwargs: options of :class:`~neutrain.optim.fused.FusedOptimizer`.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = AdamWInBackward(model.parameters(), lr=1e-3).bind(model)
        >>> model(torch.randn(3, 4)).sum().backward(); opt.step()
        >>> sorted(opt.state[model.weight])
        ['exp_avg', 'exp_avg_sq', 'step']
    """

    elementwise = True

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        **kwargs,
    ):
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid AdamW hyperparameters lr={lr}, betas={betas}, eps={eps}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, **kwargs)

    def _begin_tensor(self, weight, state, group, ok):
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=weight.device)
            state["exp_avg"] = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            state["exp_avg_sq"] = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        state["step"].add_(ok.to(torch.float32))
        beta1, beta2 = group["betas"]
        step = state["step"].clamp(min=1.0)
        return 1.0 - beta1**step, (1.0 - beta2**step).sqrt()

    def _rule_chunk(self, p32, grad, coef, state, group, rows, ok, scalars) -> torch.Tensor:
        g32 = scaled(grad, coef)
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        bias_correction1, bias_correction2_sqrt = scalars
        exp_avg = as_rows(state["exp_avg"])[rows]
        exp_avg_sq = as_rows(state["exp_avg_sq"])[rows]
        new_avg = exp_avg.lerp(g32, 1.0 - beta1)
        new_avg_sq = exp_avg_sq.mul(beta2).addcmul_(g32, g32, value=1.0 - beta2)
        exp_avg.copy_(torch.where(ok, new_avg, exp_avg))
        exp_avg_sq.copy_(torch.where(ok, new_avg_sq, exp_avg_sq))
        if wd:
            p32.mul_(1.0 - lr * wd)
        denom = (new_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        step_size = lr / bias_correction1  # a device tensor: no host sync for the bias correction
        return p32.sub_((new_avg / denom).mul_(step_size))
