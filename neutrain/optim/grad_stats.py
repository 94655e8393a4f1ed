"""A fused optimizer's gradient statistics: per-tensor norms, clip coefficients, the step's norm and skips.

Gradients arrive one tensor at a time and are freed at once, so every
statistic is kept as it goes: each tensor's squared norm joins the step's
total (on its device, no host sync), and a finiteness flag is recorded for the
non-finite policy (a tensor whose gradient is not finite keeps its weight, or,
where the update runs before its norm is known, the elements whose gradient is
not finite keep theirs: ``FusedOptimizer.updates_before_norm``; the step reports
and counts those tensors). The clip coefficient of each update
follows :class:`~neutrain.optim.clipping.ClipMode`; ``global_exact`` takes its
coefficient from a norm pass (:meth:`GradStats.norm_pass`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Callable, Iterable

import torch

from neutrain.optim.clipping import ClipMode, clip_coefficient, squared_norm

logger = logging.getLogger("neutrain.optim.fused")  # the name the skip warnings always had


class GradStats:
    """Norm bookkeeping of one fused optimizer.

    Args:
        clip_mode: the parsed clip mode.
        max_grad_norm: the threshold (None when ``clip_mode`` is ``NONE``).

    Example:
        >>> stats = GradStats(ClipMode.PER_TENSOR, 1.0)
        >>> key = torch.zeros(1)
        >>> ok = stats.account(key, torch.tensor(4.0))
        >>> stats.finish_step(lambda k: "w", step=0)
        >>> round(float(stats.clip_coef(torch.tensor(4.0))), 4), stats.last_skipped, stats.grad_norm()
        (0.5, [], 2.0)
    """

    def __init__(self, clip_mode: ClipMode, max_grad_norm: float | None):
        self.clip_mode = clip_mode
        self.max_grad_norm = max_grad_norm
        self.in_norm_pass = False
        self._norm_pass_sumsq: dict[torch.device, torch.Tensor] = {}
        self._exact_coef: torch.Tensor | None = None
        self._step_sumsq: dict[torch.device, torch.Tensor] = {}
        self._step_flags: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.prev_grad_norm: torch.Tensor | None = None
        self.last_grad_norm: torch.Tensor | None = None
        self._pending: list[_PendingFlags] = []
        self._settled: list[tuple[int, list[str]]] = []
        self._last_skipped: list[str] = []
        self._nonfinite_skips = 0

    @contextlib.contextmanager
    def norm_pass(self):
        """Measure only: gradients add to a pass total; on exit the global_exact coefficient is set from it."""
        self.in_norm_pass = True
        self._norm_pass_sumsq = {}
        try:
            yield
        finally:
            self.in_norm_pass = False
        total = sum_devices(self._norm_pass_sumsq)
        self._exact_coef = clip_coefficient(total.sqrt(), self.max_grad_norm or math.inf)

    def set_exact_coef(self, grads: Iterable[torch.Tensor], chunk_rows: Callable[[torch.Tensor], int]) -> None:
        """The global_exact coefficient from gradients at hand (a short accumulation window's sums)."""
        total: dict = {}
        for grad in grads:
            add_on_device(total, squared_norm(grad, chunk_rows(grad)))
        self._exact_coef = clip_coefficient(sum_devices(total).sqrt(), self.max_grad_norm)

    def account(self, key: torch.Tensor, sumsq: torch.Tensor) -> torch.Tensor | None:
        """Record a gradient's squared norm; returns its finiteness flag, or None in a norm pass (no update)."""
        if self.in_norm_pass:
            add_on_device(self._norm_pass_sumsq, sumsq)
            return None
        ok = torch.isfinite(sumsq)
        add_on_device(self._step_sumsq, torch.where(ok, sumsq, torch.zeros_like(sumsq)))
        self._step_flags.append((key, ok))
        return ok

    def needs_tensor_norm(self) -> bool:
        """Whether an update's clip coefficient depends on its own tensor's norm (per_tensor, first stale step)."""
        mode = self.clip_mode
        return not (mode is ClipMode.NONE or (mode is ClipMode.GLOBAL_STALE and self.prev_grad_norm is not None))

    def clip_coef(self, sumsq: torch.Tensor) -> torch.Tensor | None:
        """The coefficient the gradient of squared norm ``sumsq`` is scaled by (None: unclipped)."""
        mode = self.clip_mode
        if mode is ClipMode.NONE:
            return None
        if mode is ClipMode.GLOBAL_EXACT:
            if self._exact_coef is None:
                raise RuntimeError(
                    "clip_mode='global_exact' needs the two-pass backward: call optimizer.backward(loss), "
                    "or run loss.backward(retain_graph=True) inside `with optimizer.norm_pass():` first."
                )
            return self._exact_coef.to(sumsq.device)
        if mode is ClipMode.GLOBAL_STALE and self.prev_grad_norm is not None:
            return clip_coefficient(self.prev_grad_norm, self.max_grad_norm).to(sumsq.device)
        # per_tensor, and the first step of global_stale (no previous norm yet)
        return clip_coefficient(sumsq.sqrt(), self.max_grad_norm)

    def finish_step(self, name_of: Callable[[torch.Tensor], str], step: int, partial_group=None) -> None:
        """Close the step: its global norm, and the tensors skipped for a non-finite gradient.

        ``partial_group``: the group over which the squared norms are still partial (one all-reduce, which
        also makes the ranks agree: a tensor is skipped when any rank's shard of its gradient was non-finite).

        No host synchronisation: the finiteness flags are copied to pinned host memory
        asynchronously and read once that copy has completed (:meth:`settle`), a step or so
        later; :attr:`last_skipped` and :attr:`nonfinite_skips` wait for it when read.
        """
        if self._step_flags:
            keys, flags = zip(*self._step_flags)
            flags = torch.stack([f.to(flags[0].device) for f in flags])
            if partial_group is not None:
                flags = self._sum_partial_norms(flags, partial_group)
            self._pending.append(_PendingFlags.copy_of(flags, keys, name_of, step))
            self.last_grad_norm = sum_devices(self._step_sumsq).sqrt()
            self.prev_grad_norm = self.last_grad_norm
        self._step_sumsq, self._step_flags = {}, []
        self._exact_coef = None
        self.settle(wait=False)

    def settle(self, wait: bool = True) -> None:
        """Read the finiteness flags of closed steps whose copy has landed (all of them if ``wait``).

        Logs and counts the skipped tensors. ``wait=False`` never blocks the host.
        :meth:`drain_settled` hands each settled step to an observer once.
        """
        while self._pending and (wait or self._pending[0].ready()):
            step, skipped = self._pending.pop(0).read()
            self._last_skipped = skipped
            if skipped:
                self._nonfinite_skips += len(skipped)
                logger.warning("step %d: non-finite gradient, update skipped for %d tensor(s): %s",
                               step, len(skipped), ", ".join(skipped[:8]))
            self._settled.append((step, skipped))

    def drain_settled(self) -> list[tuple[int, list[str]]]:
        """``(step, skipped names)`` of each step settled since the last call, in step order."""
        out, self._settled = self._settled, []
        return out

    @property
    def last_skipped(self) -> list[str]:
        """Tensors the last closed step skipped for a non-finite gradient (waits for its flags)."""
        self.settle()
        return self._last_skipped

    @property
    def nonfinite_skips(self) -> int:
        """Tensors skipped so far, over all steps (waits for the flags of closed steps)."""
        self.settle()
        return self._nonfinite_skips

    @nonfinite_skips.setter
    def nonfinite_skips(self, value: int) -> None:
        self.settle()
        self._nonfinite_skips = int(value)

    def _sum_partial_norms(self, flags: torch.Tensor, group) -> torch.Tensor:
        total = sum_devices(self._step_sumsq).to(flags.device, torch.float32)
        packed = torch.cat([total.reshape(1), (~flags).to(torch.float32)])
        torch.distributed.all_reduce(packed, group=group)
        self._step_sumsq = {packed.device: packed[0]}
        return packed[1:] == 0

    def grad_norm(self) -> float | None:
        """The last completed step's global gradient norm (pre-clip, over every tensor updated), or None."""
        return None if self.last_grad_norm is None else float(self.last_grad_norm)

    def pending_grad_norm(self) -> torch.Tensor:
        """The global gradient norm of the step in progress (a device tensor: reading it syncs only if converted)."""
        return sum_devices(self._step_sumsq).sqrt()


def add_on_device(totals: dict, value: torch.Tensor) -> None:
    """``totals[value.device] += value`` (a per-device running sum: no cross-device copy per tensor)."""
    current = totals.get(value.device)
    totals[value.device] = value.clone() if current is None else current + value


def sum_devices(totals: dict) -> torch.Tensor:
    """The sum of per-device totals (0 when empty), on the first device."""
    if not totals:
        return torch.zeros((), dtype=torch.float32)
    values = list(totals.values())
    total = values[0]
    for v in values[1:]:
        total = total + v.to(total.device)
    return total


class _PendingFlags:
    """One closed step's finiteness flags on their way to the host (a non-blocking copy and its event)."""

    def __init__(self, host: torch.Tensor, event, keys, name_of: Callable[[torch.Tensor], str], step: int):
        self.host, self.event, self.keys, self.name_of, self.step = host, event, keys, name_of, step

    @classmethod
    def copy_of(cls, flags: torch.Tensor, keys, name_of, step: int) -> "_PendingFlags":
        if flags.device.type != "cuda":
            return cls(flags, None, keys, name_of, step)
        host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(host, event, keys, name_of, step)

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def read(self) -> tuple[int, list[str]]:
        if self.event is not None and not self.event.query():
            self.event.synchronize()  # only when asked to wait: a settled copy needs no sync call
        return self.step, [self.name_of(k) for k, f in zip(self.keys, self.host.tolist()) if not f]
