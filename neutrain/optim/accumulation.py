"""Gradient accumulation for fused updates: sum the early micro-batches, update in the last one.

With ``gradient_accumulation_steps = k > 1`` the gradients of the first
``k - 1`` micro-batches are summed into one fp32 buffer per trainable tensor
(4 bytes per parameter, allocated only then) and the update runs in the
``k``-th backward with the summed gradient, so the result equals ordinary
accumulation. A fused optimizer can only tell an early micro-batch from the
last if every backward goes through it (:meth:`Accumulator.begin`).
"""

from __future__ import annotations

import torch

from neutrain.optim.clipping import ClipMode
from neutrain.optim.weight_io import WeightIO


class Accumulator:
    """Micro-batch counting and the fp32 gradient sums of one fused optimizer.

    Args:
        steps: micro-batches per optimizer step (``gradient_accumulation_steps``).

    Example:
        >>> acc, key = Accumulator(2), torch.zeros(1)
        >>> acc.begin(); acc.take(key, torch.ones(1), None, in_norm_pass=False) is None  # summed
        True
        >>> acc.end(); acc.begin(); acc.take(key, torch.ones(1), None, in_norm_pass=False).tolist()
        [2.0]
    """

    def __init__(self, steps: int):
        if steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be >= 1, got {steps}")
        self.steps = int(steps)
        self.micro_batches = 0  # backward passes since the last step()
        self.accumulating = False  # inside an early micro-batch's backward
        self.inside_backward = False
        self.sums: dict[torch.Tensor, list] = {}  # key -> [fp32 sum, weight io]

    def begin(self) -> None:
        """A micro-batch's backward starts (raises after ``steps`` of them without a step())."""
        k = self.steps
        if self.micro_batches >= k:
            raise RuntimeError(
                f"{self.micro_batches} backward passes since the last optimizer.step(), but "
                f"gradient_accumulation_steps={k}: call step() after every {k} micro-batch(es)"
            )
        self.micro_batches += 1
        self.accumulating = self.micro_batches < k
        self.inside_backward = True

    def end(self) -> None:
        self.accumulating = self.inside_backward = False

    def take(self, key: torch.Tensor, grad: torch.Tensor, io: WeightIO, in_norm_pass: bool) -> torch.Tensor | None:
        """The gradient to apply now (with the sum of earlier micro-batches added), or None to wait."""
        if self.steps > 1 and not self.inside_backward:
            raise RuntimeError(
                "with gradient_accumulation_steps > 1, run every micro-batch through optimizer.backward(loss) "
                "(a bare loss.backward() cannot tell an early micro-batch from the last)"
            )
        if self.accumulating:  # an early micro-batch: sum, update later
            if in_norm_pass:
                return None
            pending = self.sums.get(key)
            if pending is None:
                self.sums[key] = [grad.to(torch.float32, copy=True), io]
            else:
                pending[0].add_(grad)
            return None
        pending = self.sums.get(key)
        if pending is not None:
            grad = pending[0] + grad
            if not in_norm_pass:  # the real backward still needs the sum
                del self.sums[key]
        return grad

    def apply_short_window(self, opt: torch.optim.Optimizer) -> None:
        """Apply the sums of a window that ended early, once, through the fused optimizer ``opt``.

        Hugging Face's loop steps early at the end of an epoch whose batch count
        is not a multiple of the accumulation.
        """
        pending, self.sums = self.sums, {}
        if opt.grad_sync is not None:  # reduce now: the exact norm below needs the averaged sums
            for entry in pending.values():
                entry[0] = opt.grad_sync.reduce_now(entry[0])
        if opt.clip_mode is ClipMode.GLOBAL_EXACT:
            opt.stats.set_exact_coef([grad for grad, _ in pending.values()], opt._chunk_rows)
        for key, (grad, io) in pending.items():
            opt._apply_reduced(key, grad, io)  # already reduced: no second all-reduce

    def reset(self) -> None:
        self.micro_batches = 0
