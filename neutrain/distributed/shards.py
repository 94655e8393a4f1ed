"""The optimizer's :class:`~neutrain.optim.sharding.Sharding` for FSDP2 and ZeRO-3 alike.

The fused optimizer asks a few things of a sharded parameter: the process group
its whole-tensor statistics are summed over (:meth:`ParameterShards.shard_groups`),
and, in its post-accumulate-grad hook, this rank's gradient slice with access to
the matching weight slice (:meth:`ParameterShards.local_shard`). FSDP2
parameters are ``DTensor`` row blocks (:mod:`neutrain.distributed.fsdp`); ZeRO-3
parameters carry a flat partition ``ds_tensor`` (:mod:`neutrain.distributed.deepspeed`).

The optimizer does not import this module: a sharded run injects
:data:`PARAMETER_SHARDS` where it builds the optimizer
(``build_fused_optimizer(..., sharding=PARAMETER_SHARDS)``), so ``optim`` stays
below ``distributed`` and knows nothing of DeepSpeed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from neutrain.distributed.deepspeed import is_zero3_param, partition_grad, submit_partition_grad
from neutrain.optim.sharding import Sharding
from neutrain.optim.weight_io import DenseWeightIO, WeightIO


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # pragma: no cover - torch without DTensor
        return None, None
    return DTensor, Shard


class ParameterShards:
    """FSDP2 ``DTensor`` shards and ZeRO-3 partitions, told apart per parameter.

    Example:
        >>> PARAMETER_SHARDS.shard_groups([torch.nn.Parameter(torch.zeros(2))])  # a whole tensor
        {}
    """

    def shard_groups(self, params) -> dict:
        """``{param: process group}`` for the parameters that are shards (FSDP2 ``DTensor`` or ZeRO-3).

        For FSDP2 the group is the mesh dimension the parameter is sharded over (for
        HSDP, the shard dimension; FSDP itself reduces over the replicate dimension);
        for ZeRO-3 the world.
        """
        DTensor, Shard = _dtensor_type()
        groups = {}
        for p in params:
            if is_zero3_param(p):
                groups[p] = dist.group.WORLD
            elif DTensor is not None and isinstance(p, DTensor):
                dims = [i for i, placement in enumerate(p.placements) if isinstance(placement, Shard)]
                if len(dims) > 1:
                    raise ValueError("fused updates support parameters sharded over one mesh dimension (FSDP2/HSDP)")
                if dims:
                    groups[p] = p.device_mesh.get_group(mesh_dim=dims[0])
        return groups

    def local_shard(self, param: torch.Tensor, grad: torch.Tensor, group) -> tuple[torch.Tensor, WeightIO]:
        """``(local gradient, weight I/O)`` for this rank's shard of ``param``."""
        if is_zero3_param(param):
            return partition_grad(param, grad, group)
        # FSDP2: the gradient is already this rank's shard of the average (reduce-scatter ran).
        return grad.to_local(), DenseWeightIO(param.to_local())

    def submit_local_shard(self, queue, param: torch.Tensor, grad: torch.Tensor, group, finish) -> bool:
        """Reduce ``grad`` into this rank's shard asynchronously, calling ``finish(local grad, io)`` when done.

        Returns False (nothing started) where the reduction has to be synchronous:
        no queue, not a ZeRO-3 parameter (FSDP2 already reduced), or not NCCL.
        """
        if queue is None or not is_zero3_param(param):
            return False
        return submit_partition_grad(queue, param, grad, finish, group)

    def full_numel(self, param: torch.Tensor) -> int:
        """Elements of the whole tensor a shard belongs to."""
        return int(param.ds_numel) if is_zero3_param(param) else param.numel()


PARAMETER_SHARDS: Sharding = ParameterShards()
"""The one instance a sharded run injects (the class holds no state)."""
