"""Non-finite steps: skip the update, log it, count it, stop after too many in a row.

The policy, for every optimizer neutrain runs:

* A step whose loss or gradient holds NaN or inf changes no weight.
  Ordinary optimizers (``adamw``, ``sgd``: torch optimizers the Trainer steps
  after backward) skip the whole update: no weight, moment or step count
  changes (:func:`guard_optimizer`). Fused optimizers skip the update of each
  tensor whose gradient is non-finite and apply the others
  (:mod:`neutrain.optim.grad_stats`, :mod:`neutrain.optim.rule`).
* The step still counts as a step: ``global_step`` advances, its batch is
  consumed and the learning-rate schedule advances, so the schedule stays tied
  to the step number (and to a resume), on both paths.
* Each such step logs a warning naming it and is counted:
  ``nonfinite_skipped_steps`` in every ``metrics.jsonl`` record and in the run
  summary.
* After ``max_consecutive`` such steps in a row, :class:`NonFiniteError` (one
  line, exit 2 from the CLI) stops the run; checkpoints already written stay.

Cost: one finite check over all gradients per step (per-tensor max-norms on the
device, one host sync), plus one tiny all-reduce when several processes train.

Example:
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    >>> monitor = watch(opt, max_consecutive=10)
    >>> model(torch.full((1, 4), float("nan"))).sum().backward()
    >>> opt.step()  # skipped: the weights and AdamW's state are unchanged
    >>> monitor.skipped_steps, opt.state[model.weight]
    (1, {})
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Sequence

import torch

from neutrain.errors import UserInputError
from neutrain.optim.fused import FusedOptimizer

logger = logging.getLogger(__name__)

NONFINITE_KEY = "nonfinite_skipped_steps"
"""The log and summary key: steps with a non-finite loss or gradient since the run began (resumes included)."""
_ATTR = "_neutrain_nonfinite_monitor"


class NonFiniteError(UserInputError):
    """Too many consecutive steps had a non-finite loss or gradient; the run stopped."""


class NonFiniteMonitor:
    """Counts steps with a non-finite loss or gradient and stops the run after too many in a row.

    Args:
        max_consecutive: Stop after this many such steps in a row (0: never stop).
        current_step: The number of the step being taken, for messages (default: counted here).
    """

    def __init__(self, max_consecutive: int, current_step: Callable[[], int] | None = None):
        self.max_consecutive = int(max_consecutive)
        self.current_step = current_step
        self.skipped_steps = 0  # in this process
        self.consecutive = 0
        self._steps = 0
        self._before_resume: int | None = None
        self._losses: list[tuple[int | None, torch.Tensor]] = []

    def note_loss(self, loss: torch.Tensor) -> None:
        """Include a micro-batch's loss in its step's check (an inf loss can have finite gradients)."""
        step = self.current_step() if self.current_step is not None else None
        self._losses.append((step, loss.detach().reshape(-1)))

    def take_losses(self) -> list[torch.Tensor]:
        """The losses noted for the step being taken (those of a step that never stepped, e.g. an fp16
        overflow the grad scaler skipped, are dropped)."""
        step = self.current_step() if self.current_step is not None else None
        losses, self._losses = self._losses, []
        return [loss for noted, loss in losses if noted == step]

    def record(self, nonfinite: bool, what: str = "", warn: bool = True) -> None:
        """Note one optimizer step; raise :class:`NonFiniteError` when the limit of consecutive ones is reached."""
        self._steps += 1
        if not nonfinite:
            self.consecutive = 0
            return
        step = self.current_step() if self.current_step is not None else self._steps
        self.skipped_steps += 1
        self.consecutive += 1
        if warn:
            logger.warning("step %d: non-finite loss or gradient%s, optimizer step skipped (weights and optimizer "
                           "state unchanged; %d in a row)", step, f" ({what})" if what else "", self.consecutive)
        if self.max_consecutive and self.consecutive >= self.max_consecutive:
            raise NonFiniteError(
                f"{self.consecutive} optimizer steps in a row (steps {step - self.consecutive + 1}-{step}) had a "
                f"non-finite loss or gradient and were skipped; stopped (train.max_consecutive_nonfinite: "
                f"{self.max_consecutive}). The checkpoints written so far are kept; lower train.learning_rate, "
                "check the data, or raise the limit")

    def total(self, log_history: Sequence[dict] = ()) -> int:
        """Skipped steps over the whole run: this process's plus those logged before a resume.

        ``log_history`` is the Trainer's (restored from the checkpoint on resume); it is read once,
        on the first call, before this process logs anything of its own.
        """
        if self._before_resume is None:
            self._before_resume = max((int(h[NONFINITE_KEY]) for h in log_history if NONFINITE_KEY in h), default=0)
        return self._before_resume + self.skipped_steps


def all_finite(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """One boolean device tensor: whether every element of every tensor is finite (no host sync).

    The max-norm of a tensor is NaN or inf exactly when an element is, and unlike the 2-norm it cannot
    overflow for large finite values.

    Example:
        >>> bool(all_finite([torch.ones(3), torch.tensor([1.0, float("inf")])]))
        False
    """
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]  # DTensor gradients (FSDP2)
    local = [t for t in local if t.numel()]
    if not local:
        return torch.ones((), dtype=torch.bool)
    device = local[0].device
    norms = torch._foreach_norm(local, ord=float("inf"))
    return torch.isfinite(torch.stack([n.to(device, torch.float32) for n in norms])).all()


def _agree(flag: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``flag`` and-ed over all processes, so that every rank skips the same steps (sharded gradients differ)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    bad = (~flag).to(device, torch.float32).reshape(1)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad[0] == 0


def guard_optimizer(optimizer: torch.optim.Optimizer, monitor: NonFiniteMonitor) -> None:
    """Skip ``optimizer``'s whole step when any gradient, or a loss noted since the last step, is non-finite.

    A step pre-hook.
    Every gradient is dropped first: torch optimizers leave a parameter without a gradient untouched
    (no weight decay, no moment or step-count update), so the step that follows changes nothing.
    """

    def check(opt, args, kwargs):
        params = [p for group in opt.param_groups for p in group["params"]]
        grads = [p.grad for p in params if p.grad is not None] + monitor.take_losses()
        if not params:
            return None
        ok = bool(_agree(all_finite(grads), params[0].device))  # the one host sync of the step
        if not ok:
            for p in params:
                p.grad = None
        monitor.record(not ok)
        return None

    optimizer.register_step_pre_hook(check)


def _watch_fused(optimizer, monitor: NonFiniteMonitor) -> None:
    """Count the fused optimizer's steps that skipped a tensor (it already skips and logs per tensor)."""

    def after(opt, args, kwargs):
        # Steps whose flags have reached the host (a step or so late): no host sync per step.
        opt.stats.settle(wait=False)
        for _, skipped in opt.stats.drain_settled():
            monitor.record(bool(skipped), what=", ".join(skipped[:4]), warn=False)

    optimizer.register_step_post_hook(after)


def watch(optimizer: torch.optim.Optimizer, max_consecutive: int = 10,
          current_step: Callable[[], int] | None = None) -> NonFiniteMonitor:
    """Apply the non-finite policy to ``optimizer`` (ordinary or fused); returns its monitor.

    Idempotent: a second call on the same optimizer returns the first monitor.
    """
    monitor = getattr(optimizer, _ATTR, None)
    if monitor is None:
        monitor = NonFiniteMonitor(max_consecutive, current_step)
        (_watch_fused if isinstance(optimizer, FusedOptimizer) else guard_optimizer)(optimizer, monitor)
        setattr(optimizer, _ATTR, monitor)
    return monitor
