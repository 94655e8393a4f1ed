"""AdaLomo: Adafactor-style adaptive updates inside backward (Lv et al., arXiv 2310.10195).

Per tensor, with ``g`` the (clipped) gradient and ``t`` the tensor's step count,
following ``lomo_optim.AdaLomo`` (docs/trainer.md §1):

* ``beta2_t = 1 - t ** decay_rate`` (``decay_rate = -0.8``; ``beta2_1 = 0``);
* ``s = g**2 + eps[0]``; for matrices keep factored second moments
  ``R <- beta2_t R + (1 - beta2_t) mean_cols(s)`` and
  ``C <- beta2_t C + (1 - beta2_t) mean_rows(s)`` and set
  ``u = g * rsqrt(R / mean(R))[:, None] * rsqrt(C)[None, :]``; vectors keep a full
  ``V`` and set ``u = g * rsqrt(V)``;
* grouped update normalisation: ``u /= max(1, RMS(u) / clip_threshold)``;
* relative step: ``lr_t = lr * max(eps[1], RMS(w))``;
* ``w <- w * (1 - lr_t * wd) - lr_t * u``.

Unlike the pip package, the moments live in ``self.state[key]`` (so they
survive ``state_dict()``), the step count is per tensor, and no fixed loss scale
is applied (bf16 gradients have fp32's exponent range). State costs
``rows + cols`` floats per matrix.

Whole-tensor statistics (``mean(R)``, ``RMS(u)``, ``RMS(w)``) are gathered
chunk by chunk, so the update runs in three passes over row chunks without an
fp32 copy of the tensor.
"""

from __future__ import annotations

from typing import Iterable

import torch

from neutrain.optim.clipping import as_rows
from neutrain.optim.fused import FusedOptimizer
from neutrain.optim.rule import scaled


class AdaLomo(FusedOptimizer):
    """Fused AdaLomo.

    Args:
        params: parameters or groups.
        lr: learning rate (the package's default 1e-3; docs/trainer.md §1: 5e-4-1e-3 in practice).
        eps: ``(eps_sq, eps_scale)``: added to squared gradients, and the floor of
            the parameter RMS that scales the step.
        clip_threshold: RMS above which the update is renormalised.
        decay_rate: exponent of the second-moment decay schedule.
        weight_decay: decoupled weight decay (scaled by the relative step).
        **kwargs: options of :class:`~neutrain.optim.fused.FusedOptimizer`.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = AdaLomo(model.parameters(), lr=1e-3).bind(model)
        >>> model(torch.randn(3, 4)).sum().backward(); opt.step()
        >>> sorted(opt.state[model.weight])
        ['exp_avg_sq_col', 'exp_avg_sq_row', 'step']
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        eps: tuple[float, float] = (1e-30, 1e-3),
        clip_threshold: float = 1.0,
        decay_rate: float = -0.8,
        weight_decay: float = 0.0,
        **kwargs,
    ):
        if lr < 0 or clip_threshold <= 0:
            raise ValueError(f"invalid AdaLomo hyperparameters lr={lr}, clip_threshold={clip_threshold}")
        defaults = dict(
            lr=lr, eps=tuple(eps), clip_threshold=clip_threshold, decay_rate=decay_rate, weight_decay=weight_decay
        )
        super().__init__(params, defaults, **kwargs)

    def _update_tensor(self, weight, grad, state, group, ok, coef, generator) -> None:
        key = self._updating_key
        eps_sq, eps_scale = group["eps"]
        factored = weight.dim() >= 2
        w_rows, g_rows = as_rows(weight), as_rows(grad)
        n_rows, n_cols = w_rows.shape
        device = weight.device
        # Under FSDP2 ``weight`` is this rank's row shard: whole-tensor sums go through shard_sum_.
        numel = self.full_numel(key, weight)
        total_rows = numel // max(1, n_cols)
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=device)
            if factored:
                state["exp_avg_sq_row"] = torch.zeros(n_rows, dtype=torch.float32, device=device)
                state["exp_avg_sq_col"] = torch.zeros(n_cols, dtype=torch.float32, device=device)
            else:
                state["exp_avg_sq"] = torch.zeros(weight.shape, dtype=torch.float32, device=device)
        state["step"].add_(ok.to(torch.float32))
        beta = 1.0 - state["step"].clamp(min=1.0).pow(group["decay_rate"])

        # Pass 1: second-moment statistics of this gradient, and ||w||^2.
        weight_sumsq = torch.zeros((), dtype=torch.float32, device=device)
        if factored:
            row_mean = torch.empty(n_rows, dtype=torch.float32, device=device)
            col_sum = torch.zeros(n_cols, dtype=torch.float32, device=device)
        for rows in self._row_chunks(weight):
            g32 = scaled(g_rows[rows], coef)
            sq = g32.square().add_(eps_sq)
            if factored:
                row_mean[rows] = sq.mean(dim=-1)
                col_sum += sq.sum(dim=0)
            else:
                new_v = state["exp_avg_sq"].mul(beta).add_(sq.view(weight.shape) * (1.0 - beta))
            weight_sumsq += w_rows[rows].float().square().sum()
        self.shard_sum_(key, weight_sumsq)
        if factored:
            self.shard_sum_(key, col_sum)
            new_row = state["exp_avg_sq_row"].mul(beta).add_(row_mean * (1.0 - beta))
            new_col = state["exp_avg_sq_col"].mul(beta).add_((col_sum / total_rows) * (1.0 - beta))
            _masked_copy(state["exp_avg_sq_row"], new_row, ok)
            _masked_copy(state["exp_avg_sq_col"], new_col, ok)
            if key in self.shards:
                row_mean_all = self.shard_sum_(key, new_row.sum()) / total_rows
            else:
                row_mean_all = new_row.mean()
            row_scale = (new_row / row_mean_all).rsqrt_()
            col_scale = new_col.rsqrt()
        else:
            _masked_copy(state["exp_avg_sq"], new_v, ok)
            inv_sqrt_v = as_rows(new_v.rsqrt())

        def preconditioned(rows: slice) -> torch.Tensor:
            g32 = scaled(g_rows[rows], coef)
            if factored:
                return g32 * row_scale[rows, None] * col_scale[None, :]
            return g32 * inv_sqrt_v[rows]

        # Pass 2: RMS of the preconditioned update (grouped update normalisation).
        update_sumsq = torch.zeros((), dtype=torch.float32, device=device)
        for rows in self._row_chunks(weight):
            update_sumsq += preconditioned(rows).square().sum()
        self.shard_sum_(key, update_sumsq)
        update_rms = (update_sumsq / numel).sqrt()
        update_scale = 1.0 / (update_rms / group["clip_threshold"]).clamp(min=1.0)
        weight_rms = (weight_sumsq / numel).sqrt()
        lr = group["lr"] * weight_rms.clamp(min=eps_scale)
        decay = 1.0 - lr * group["weight_decay"]

        # Pass 3: apply.
        for rows in self._row_chunks(weight):
            p32 = w_rows[rows].float()
            if group["weight_decay"]:
                p32 = p32 * decay
            new32 = p32 - (lr * update_scale) * preconditioned(rows)
            self._write_rows(w_rows[rows], new32, ok, generator)


def _masked_copy(dst: torch.Tensor, new: torch.Tensor, ok: torch.Tensor) -> None:
    dst.copy_(torch.where(ok, new, dst))
