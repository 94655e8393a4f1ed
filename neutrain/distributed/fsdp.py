"""FSDP2 (``fully_shard``) with fused updates: each rank updates its own shard.

FSDP2 reduce-scatters gradients per ``fully_shard`` unit and, for every
sharded parameter, runs the parameter's post-accumulate-grad hooks on the
local shard right after (``_fsdp_collectives.foreach_reduce``); plain tensor
hooks never see the reduced gradient (torchrec#4268). The hooks must be
registered on the sharded (``DTensor``) parameters, which exist only after
``fully_shard``: Accelerate replaces the model's parameters and the optimizer's
param groups in ``prepare`` (FSDP2 requires the optimizer before), so the fused
optimizer is re-indexed and re-bound afterwards (:func:`bind_after_prepare`).

In the hook the gradient is this rank's shard of the averaged gradient and the
weight is this rank's shard (``DTensor.to_local()``, a view of the sharded
storage, updated in place). Element-wise rules (LOMO, AdamW) need nothing more.
Whole-tensor statistics (a tensor's squared norm for clipping and the global
norm, AdaLomo's column means, update and weight RMS) are summed over the shard
group by :meth:`FusedOptimizer.shard_sum_`, so that a sharded update equals the
unsharded one up to the order of sums.

Compressed weights are not sharded (``weights: dense`` is required with
FSDP2). FSDP2 can all-gather a tensor subclass through
``fsdp_pre_all_gather``/``fsdp_post_all_gather``, but it shards every parameter
along dim 0 into equal byte ranges of one flat buffer per unit, while a NeuZip
tensor is an entropy-coded byte stream whose length changes at every update:
the shards would need padding to a per-tensor maximum that is only known after
re-encoding, a re-layout of the flat buffer when it grows, and a decode that
re-assembles rows split across ranks' streams. Sharding dense weights already
divides weight memory by N, which is what compression buys on one GPU.
"""

from __future__ import annotations

import torch


def bind_after_prepare(optimizer, model: torch.nn.Module):
    """Re-index and re-bind a fused optimizer after Accelerate applied ``fully_shard``.

    Accelerate swapped the optimizer's parameters for the sharded ``DTensor``
    ones; the hooks registered before are on parameters that no longer exist.
    Returns the optimizer. Idempotent.
    """
    from neutrain.nn_checkpoint import is_compressed

    if is_compressed(model):
        raise ValueError("FSDP2 shards dense weights only: set memory.weights: dense (see neutrain.distributed.fsdp)")
    optimizer._reindex()
    optimizer.bind(model)
    if not optimizer._shard_groups:
        raise RuntimeError("FSDP2 mode but no parameter of the optimizer is sharded: was the model prepared?")
    return optimizer


def optimizer_shard_file(directory: str, rank: int, world_size: int) -> str:
    """Where rank ``rank`` of ``world_size`` keeps its optimizer shard in a checkpoint directory."""
    import os

    return os.path.join(directory, f"optimizer.rank{rank}-of-{world_size}.pt")


def save_optimizer_shard(optimizer, directory: str, rank: int, world_size: int) -> str:
    """Write this rank's fused-optimizer state (its shards' moments, the step bookkeeping).

    Why not ``torch.distributed.checkpoint``'s optimizer state dict: it initialises
    an empty state by running ``optimizer.step()`` on zero gradients, which for a
    fused optimizer is end-of-step bookkeeping (it would count a step). A checkpoint
    written with N processes resumes with N processes (the shards line up).
    """
    path = optimizer_shard_file(directory, rank, world_size)
    torch.save(optimizer.state_dict(), path)
    return path


def load_optimizer_shard(optimizer, directory: str, rank: int, world_size: int) -> None:
    """Load what :func:`save_optimizer_shard` wrote for this rank (same number of processes required)."""
    import os

    path = optimizer_shard_file(directory, rank, world_size)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} not found: an FSDP2 checkpoint resumes with the number of processes that wrote it"
        )
    optimizer.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))
