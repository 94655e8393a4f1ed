"""Sharded parameters, seen from the optimizer: an interface that a distributed backend implements.

Under FSDP2 or ZeRO-3 each rank holds a shard of some parameters and updates
only that shard. The optimizer needs four answers about such a parameter, and
nothing else about the backend: which parameters are shards and over which
process group (:meth:`Sharding.shard_groups`), this rank's slice of a gradient
with access to the matching weight slice (:meth:`Sharding.local_shard`, or
:meth:`Sharding.submit_local_shard` to reduce asynchronously), and the size of
the whole tensor (:meth:`Sharding.full_numel`). :mod:`neutrain.distributed.shards`
implements it for FSDP2 ``DTensor`` and ZeRO-3 partitions and is injected where
a sharded run builds its optimizer (``sharding=`` of the optimizer or of
:func:`~neutrain.optim.factory.build_fused_optimizer`); without one, no
parameter is a shard. Keeping the backend behind this seam is what lets the
optimizer sit below ``distributed`` in the layers.

:class:`ShardMap` is the optimizer's part: the shard groups of the bound
parameters, and the sums over them that make a sharded update equal the
unsharded one.
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

import torch

from neutrain.optim.weight_io import WeightIO


class Sharding(Protocol):
    """What a fused optimizer asks of the backend that sharded its parameters.

    Example:
        >>> class NoShards:  # the smallest implementation: nothing is a shard
        ...     def shard_groups(self, params): return {}
        ...     def local_shard(self, param, grad, group): raise AssertionError("no shards")
        ...     def submit_local_shard(self, queue, param, grad, group, finish): return False
        ...     def full_numel(self, param): return param.numel()
        >>> from neutrain.optim import LOMO
        >>> model = torch.nn.Linear(2, 2)
        >>> len(LOMO(model.parameters(), lr=0.1, sharding=NoShards()).bind(model).shards)
        0
    """

    def shard_groups(self, params: Iterable[torch.Tensor]) -> dict[torch.Tensor, object]:
        """``{param: process group}`` for the parameters that are shards; the group sums whole-tensor statistics."""
        ...

    def local_shard(self, param: torch.Tensor, grad: torch.Tensor, group: object) -> tuple[torch.Tensor, WeightIO]:
        """``(this rank's gradient slice, I/O of the matching weight slice)``, reduced synchronously."""
        ...

    def submit_local_shard(self, queue, param: torch.Tensor, grad: torch.Tensor, group: object,
                           finish: Callable[[torch.Tensor, WeightIO], None]) -> bool:
        """Reduce asynchronously on ``queue``, calling ``finish(local grad, io)`` when done; False: nothing started."""
        ...

    def full_numel(self, param: torch.Tensor) -> int:
        """Elements of the whole tensor the shard ``param`` belongs to."""
        ...


class ShardMap:
    """The bound parameters that are shards, and the whole-tensor sums over their groups.

    Args:
        sharding: the backend's :class:`Sharding`, or None (nothing is a shard).
    """

    def __init__(self, sharding: Sharding | None = None):
        self.sharding = sharding
        self.groups: dict[torch.Tensor, object] = {}
        # The group every bound tensor is a shard of, if there is exactly one (else None): only then may
        # squared norms stay partial until step() (a whole tensor's norm would be counted once per rank).
        self.common_group = None
        # The group over which this step's squared norms are still partial (summed once, in step()).
        self.partial_group = None

    def __len__(self) -> int:
        return len(self.groups)

    def __contains__(self, key: torch.Tensor) -> bool:
        return key in self.groups

    def rebuild(self, params: dict | list) -> None:
        """Find the shards among ``params`` (the optimizer's parameters; called on every bind)."""
        self.groups = {} if self.sharding is None else self.sharding.shard_groups(params)
        groups = set(self.groups.values())
        self.common_group = groups.pop() if len(groups) == 1 and len(self.groups) == len(params) else None

    def sum_(self, key: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` in place over the ranks holding shards of ``key``; identity for whole tensors."""
        group = self.groups.get(key)
        if group is not None:
            torch.distributed.all_reduce(t, group=group)
        return t

    def tensor_sumsq(self, key: torch.Tensor, sumsq: torch.Tensor, may_defer: bool) -> torch.Tensor:
        """A gradient's squared norm over the whole tensor, or this shard's part when the sum may wait for step().

        One collective per tensor would stall backward behind every reduce-scatter in flight; when the
        update needs no whole-tensor statistic (``may_defer``) and every tensor is a shard of one group,
        the partial norms are summed once, in step().
        """
        if may_defer and self.common_group is not None:
            self.partial_group = self.common_group
            return sumsq
        return self.sum_(key, sumsq)

    def full_numel(self, key: torch.Tensor, weight: torch.Tensor) -> int:
        """Elements of the whole tensor behind ``key`` (``weight`` may be this rank's shard)."""
        if key not in self.groups:
            return weight.numel()
        return self.sharding.full_numel(key)

    def route(self, param: torch.Tensor, grad: torch.Tensor, queue,
              consume: Callable[[torch.Tensor, torch.Tensor, WeightIO], None]) -> bool:
        """Hand ``consume`` this rank's slice of a shard's gradient (asynchronously on ``queue`` if possible).

        Returns False, doing nothing, when ``param`` is not a shard.
        """
        if param not in self.groups:
            return False
        group = self.groups[param]
        if not self.sharding.submit_local_shard(queue, param, grad, group, lambda g, io: consume(param, g, io)):
            consume(param, *self.sharding.local_shard(param, grad, group))
        return True
