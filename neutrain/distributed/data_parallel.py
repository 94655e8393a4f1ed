"""Replicated data parallelism for fused updates: one asynchronous all-reduce per gradient.

DDP does not fit fused updates (docs/trainer.md §4): its bucketed all-reduce runs
after the gradients are consumed, so LOMO's replicas silently drift, and its
buckets hold a full gradient of memory, which is what fused updates remove.
Here every process holds the whole (dense or compressed) model and the model is
*not* wrapped in DDP. Instead the fused optimizer hands each finished gradient
to :class:`GradientAllReduce`, which starts ``all_reduce(SUM)`` asynchronously
and applies the update once it completes, divided by the world size. While a
gradient is on the wire, backward goes on computing the next ones; at most
``max_inflight`` gradients wait (memory: that many extra gradients, not a
bucket of everything).

Every rank then applies the same deterministic update (same averaged gradient,
same seeded stochastic rounding) to the same weights, so replicas stay
identical without ever exchanging weights. Norms, clipping, AdaLomo's RMS and
the non-finite check all see the averaged gradient. The result equals the
single-process run on the same global batch up to the order of floating-point
sums. Accumulation (``gradient_accumulation_steps > 1``) sums micro-batches
locally and reduces once, like DDP's ``no_sync``.

Example:
    >>> # inside a process group (torchrun / accelerate launch), so not run here:
    >>> opt = build_fused_optimizer(model, "lomo", lr=1e-3)  # doctest: +SKIP
    >>> attach(opt, model)                  # doctest: +SKIP
    >>> opt.backward(model(x).loss); opt.step()  # doctest: +SKIP
"""

from __future__ import annotations

import collections
from typing import Callable

import torch
import torch.distributed as dist

from neutrain.compat.autograd import in_backward


class GradientAllReduce:
    """Average gradients over a process group with one asynchronous all-reduce each.

    Args:
        group: the process group (default: the world).
        max_inflight: reductions allowed to be in flight before the oldest is
            waited for and its update applied.

    Counters ``submitted`` and ``completed`` let tests check that the path ran.
    """

    def __init__(self, group=None, max_inflight: int = 2):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.max_inflight = max(0, int(max_inflight))
        self._pending: collections.deque = collections.deque()
        self._drain_queued = False
        self.submitted = 0
        self.completed = 0

    def submit(self, grad: torch.Tensor, finish: Callable[[torch.Tensor], None]) -> None:
        """Start reducing ``grad`` (in place); ``finish(averaged_grad)`` runs once it is done.

        Inside backward, whatever is still in flight when backward ends is
        finished by an end-of-backward callback; outside, by :meth:`drain`
        (the optimizer's ``step()`` calls it).
        """
        if not grad.is_contiguous():
            grad = grad.contiguous()
        self.enqueue(dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.group, async_op=True), grad, finish)

    def enqueue(self, work, reduced: torch.Tensor, finish: Callable[[torch.Tensor], None]) -> None:
        """Queue a collective already started (``async_op=True``) that sums into ``reduced``.

        ``finish(reduced / world_size)`` runs once ``work`` is done, in submission
        order (ZeRO-3's reduce-scatters use this queue too).
        """
        self._pending.append((work, reduced, finish))
        self.submitted += 1
        if in_backward() and not self._drain_queued:
            self._drain_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        while len(self._pending) > self.max_inflight:
            self._finish_oldest()

    def reduce_now(self, grad: torch.Tensor) -> torch.Tensor:
        """Average ``grad`` synchronously and return it (a contiguous tensor, possibly ``grad`` itself)."""
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.group)
        return grad.div_(self.world_size)

    def drain(self) -> None:
        """Wait for every reduction in flight and apply its update, oldest first."""
        while self._pending:
            self._finish_oldest()

    def _end_of_backward(self) -> None:
        self._drain_queued = False
        self.drain()

    @torch.no_grad()
    def _finish_oldest(self) -> None:
        work, grad, finish = self._pending.popleft()
        work.wait()
        finish(grad.div_(self.world_size))
        self.completed += 1


@torch.no_grad()
def broadcast_replicas(model: torch.nn.Module, src: int = 0, group=None) -> int:
    """Copy rank ``src``'s dense parameters and buffers to every rank (what DDP does at wrap time).

    Compressed weights are not sent: they are built deterministically from the
    same checkpoint or seed on every rank, and re-encoded identically after
    every update. Returns the number of tensors broadcast.
    """
    count = 0
    tensors = list(model.parameters()) + list(model.buffers())
    for t in tensors:
        if t.numel() == 0 or not t.is_floating_point():
            continue
        dist.broadcast(t.data, src=src, group=group)
        count += 1
    return count


def attach(optimizer, model: torch.nn.Module, group=None, max_inflight: int = 2) -> GradientAllReduce:
    """Make a fused optimizer replicated-data-parallel: equal replicas, averaged gradients.

    Args:
        optimizer: a bound :class:`~neutrain.optim.FusedOptimizer`.
        model: the (unwrapped) model it updates.
        group: process group (default: the world).
        max_inflight: see :class:`GradientAllReduce`.

    Returns:
        The :class:`GradientAllReduce` now installed as ``optimizer.grad_sync``.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("replicated data parallel needs an initialised process group (accelerate launch / torchrun)")
    broadcast_replicas(model, group=group)
    optimizer.grad_sync = GradientAllReduce(group, max_inflight)
    return optimizer.grad_sync
