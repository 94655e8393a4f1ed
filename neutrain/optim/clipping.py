"""Gradient clipping and gradient-norm bookkeeping for fused updates.

A fused optimizer sees one tensor's gradient at a time and frees it at once, so
the usual ``clip_grad_norm_`` (which needs every gradient alive) is impossible.
Three modes trade exactness against cost (docs/trainer.md §1, §7):

* ``per_tensor``: scale each gradient so that its own norm is at most
  ``max_grad_norm``. Free, but a different rule from global clipping.
* ``global_stale``: scale every gradient of step *t* by
  ``min(1, max_grad_norm / ||g_{t-1}||)``, the global norm measured during the
  previous step. Free; lags one step. The first step, which has no previous
  norm, falls back to ``per_tensor``. No update needs its own tensor's norm
  first, so the streamed lm_head update runs in one pass (its gradient computed
  once: :mod:`neutrain.optim.streamed`).
* ``global_exact``: LOMO's two-pass backward. A first backward only sums the
  squared norms and drops the gradients; the second applies the updates with
  the exact coefficient. Exact, at twice the backward cost.

Whatever the mode, the norm reported for logging is the real one: the square
root of the sum over all tensors of the step of their squared (pre-clip) norms.
All arithmetic stays on the device; nothing here forces a host sync.
"""

from __future__ import annotations

import enum

import torch

# Same epsilon as torch.nn.utils.clip_grad_norm_ and LOMO.
CLIP_EPS = 1e-6


class ClipMode(str, enum.Enum):
    """How gradients are clipped before a fused update."""

    NONE = "none"
    PER_TENSOR = "per_tensor"
    GLOBAL_STALE = "global_stale"
    GLOBAL_EXACT = "global_exact"

    @classmethod
    def parse(cls, value: "ClipMode | str | None", max_grad_norm: float | None) -> "ClipMode":
        """Normalise user input; no ``max_grad_norm`` means no clipping."""
        if value is None or max_grad_norm is None or max_grad_norm <= 0:
            return cls.NONE
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown clip mode {value!r}; choose one of: {choices}") from None


def clip_coefficient(norm: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """``min(1, max_grad_norm / (norm + eps))`` as an fp32 device tensor."""
    return (max_grad_norm / (norm.float() + CLIP_EPS)).clamp(max=1.0)


def squared_norm(grad: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """Sum of squares of ``grad`` in fp32, without an fp32 copy of the whole tensor.

    Args:
        grad: any floating tensor, viewed as rows (``grad.view(rows, -1)``).
        chunk_rows: rows upcast at a time.

    Returns:
        A 0-dim fp32 tensor; non-finite if any element is non-finite (or the
        sum overflows fp32, which needs elements beyond about 1e19).
    """
    rows = as_rows(grad)
    total = torch.zeros((), dtype=torch.float32, device=grad.device)
    for start in range(0, rows.shape[0], chunk_rows):
        add_squared_norm_(total, rows[start : start + chunk_rows])
    return total


def add_squared_norm_(total: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
    """``total += ||chunk||^2`` in fp32: the one accumulation step every norm here uses.

    Callers that produce a gradient chunk by chunk (the streamed lm_head update)
    use it over the same chunks, in order, to get the bit-identical total.
    """
    # One fused reduction reading the chunk once (upcast inside the kernel).
    return total.add_(torch.linalg.vector_norm(chunk, dtype=torch.float32).square())


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """View a tensor as 2-D rows (1-D and 0-D tensors become a single row)."""
    if t.dim() >= 2:
        return t.reshape(t.shape[0], -1)
    return t.reshape(1, -1)
