"""Which parameters are shards, and their local gradient and weight, for FSDP2 and ZeRO-3 alike.

The fused optimizer asks two things of a sharded parameter: the process group
its whole-tensor statistics are summed over (:func:`shard_groups`), and, in its
post-accumulate-grad hook, this rank's gradient slice with access to the
matching weight slice (:func:`local_shard`). FSDP2 parameters are ``DTensor``
row blocks (:mod:`neutrain.distributed.fsdp`); ZeRO-3 parameters carry a flat
partition ``ds_tensor`` (:mod:`neutrain.distributed.deepspeed`).
"""

from __future__ import annotations

import torch

from neutrain.distributed.deepspeed import is_zero3_param, partition_grad


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # pragma: no cover - torch without DTensor
        return None, None
    return DTensor, Shard


def shard_groups(params) -> dict:
    """``{param: process group}`` for the parameters that are shards (FSDP2 ``DTensor`` or ZeRO-3).

    For FSDP2 the group is the mesh dimension the parameter is sharded over (for
    HSDP, the shard dimension; FSDP itself reduces over the replicate dimension);
    for ZeRO-3 the world.
    """
    DTensor, Shard = _dtensor_type()
    groups = {}
    for p in params:
        if is_zero3_param(p):
            import torch.distributed as dist

            groups[p] = dist.group.WORLD
        elif DTensor is not None and isinstance(p, DTensor):
            dims = [i for i, placement in enumerate(p.placements) if isinstance(placement, Shard)]
            if len(dims) > 1:
                raise ValueError("fused updates support parameters sharded over one mesh dimension (FSDP2/HSDP)")
            if dims:
                groups[p] = p.device_mesh.get_group(mesh_dim=dims[0])
    return groups


def local_shard(param: torch.Tensor, grad: torch.Tensor, group):
    """``(local gradient, weight I/O)`` for this rank's shard of ``param``."""
    from neutrain.optim.fused import DenseWeightIO

    if is_zero3_param(param):
        return partition_grad(param, grad, group)
    # FSDP2: the gradient is already this rank's shard of the average (reduce-scatter ran).
    return grad.to_local(), DenseWeightIO(param.to_local())


def submit_local_shard(queue, param: torch.Tensor, grad: torch.Tensor, group, finish) -> bool:
    """Reduce ``grad`` into this rank's shard asynchronously, calling ``finish(local grad, io)`` when done.

    Returns False (nothing started) where the reduction has to be synchronous:
    no queue, not a ZeRO-3 parameter (FSDP2 already reduced), or not NCCL.
    """
    if queue is None or not is_zero3_param(param):
        return False
    from neutrain.distributed.deepspeed import submit_partition_grad

    return submit_partition_grad(queue, param, grad, finish, group)


def full_numel(param: torch.Tensor) -> int:
    """Elements of the whole tensor a shard belongs to."""
    return int(param.ds_numel) if is_zero3_param(param) else param.numel()
