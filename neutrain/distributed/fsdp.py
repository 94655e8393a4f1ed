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

import json
import os
from pathlib import Path

import torch

from neutrain.errors import CheckpointError

SHARD_FORMAT = "neutrain-fsdp2-shard"


def bind_after_prepare(optimizer, model: torch.nn.Module):
    """Re-index and re-bind a fused optimizer after Accelerate applied ``fully_shard``.

    Accelerate swapped the optimizer's parameters for the sharded ``DTensor``
    ones; the hooks registered before are on parameters that no longer exist.
    Returns the optimizer. Idempotent.
    """
    from neutrain.nn.checkpoint import is_compressed

    if is_compressed(model):
        raise ValueError("FSDP2 shards dense weights only: set memory.weights: dense (see neutrain.distributed.fsdp)")
    optimizer._reindex()
    optimizer.bind(model)
    if not optimizer.shards:
        raise RuntimeError("FSDP2 mode but no parameter of the optimizer is sharded: was the model prepared, and the "
                           "optimizer built with sharding=neutrain.distributed.shards.PARAMETER_SHARDS?")
    return optimizer


def optimizer_shard_file(directory: str, rank: int, world_size: int) -> str:
    """Where rank ``rank`` of ``world_size`` keeps its optimizer shard (safetensors plus JSON) in a checkpoint."""
    return os.path.join(directory, f"optimizer.rank{rank}-of-{world_size}.safetensors")


def model_shard_file(directory: str, rank: int, world_size: int) -> str:
    """Where rank ``rank`` of ``world_size`` keeps its model shards (safetensors) in a checkpoint directory."""
    return os.path.join(directory, f"model.rank{rank}-of-{world_size}.safetensors")


def save_optimizer_shard(optimizer, directory: str, rank: int, world_size: int) -> str:
    """Write this rank's optimizer state: a fused optimizer's (its shards' moments, the step bookkeeping) or an
    ordinary one's (AdamW's or SGD's ``DTensor`` moments, as this rank's local shards); returns the file.

    Why not ``torch.distributed.checkpoint`` (Accelerate's ``save_fsdp_optimizer``): its
    ``.metadata`` is a pickle, and its optimizer state dict initialises an empty state by
    running ``optimizer.step()`` on zero gradients, which for a fused optimizer is
    end-of-step bookkeeping (it would count a step). The file is safetensors with the
    non-tensor state as JSON (:mod:`neutrain.distributed.state_files`): nothing is
    unpickled at resume. A checkpoint written with N processes resumes with N processes
    (the shards line up).
    """
    from neutrain.distributed.state_files import save_optimizer_state

    return save_optimizer_state(optimizer, optimizer_shard_file(directory, rank, world_size),
                                {"rank": str(rank), "world_size": str(world_size)})


def load_optimizer_shard(optimizer, directory: str, rank: int, world_size: int) -> None:
    """Load what :func:`save_optimizer_shard` wrote for this rank (same number of processes required)."""
    from neutrain.distributed.state_files import load_optimizer_state

    path = optimizer_shard_file(directory, rank, world_size)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file '{path}' is missing: a sharded checkpoint resumes with the number "
                              f"of processes that wrote it (this run has {world_size})")
    load_optimizer_state(optimizer, path)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def save_model_shard(model: torch.nn.Module, directory: str, rank: int, world_size: int) -> str:
    """Write this rank's FSDP2 shards (``DTensor.to_local()``) and buffers as safetensors; returns the file.

    Why not ``torch.distributed.checkpoint`` (what Accelerate's ``save_fsdp_model``
    uses): its ``.metadata`` file is a pickle that resume would unpickle. One
    safetensors file per rank holds nothing but tensors; FSDP2 shards every
    parameter along dim 0 in rank order, so :func:`merge_model_shards` rebuilds
    the whole tensors by concatenation.
    """
    from safetensors.torch import save_file

    state = {name: _local(t).detach().cpu().contiguous().clone() for name, t in model.state_dict().items()}
    path = model_shard_file(directory, rank, world_size)
    save_file(state, path, metadata={"format": SHARD_FORMAT, "rank": str(rank), "world_size": str(world_size),
                                     "sharded": json.dumps(sorted(n for n, t in model.state_dict().items()
                                                                  if hasattr(t, "to_local")))})
    return path


@torch.no_grad()
def load_model_shard(model: torch.nn.Module, directory: str, rank: int, world_size: int) -> None:
    """Copy what :func:`save_model_shard` wrote for this rank into the model's local shards and buffers."""
    from safetensors.torch import load_file

    path = model_shard_file(directory, rank, world_size)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file '{path}' is missing: an FSDP2 checkpoint resumes with the number "
                              f"of processes that wrote it (this run has {world_size})")
    saved = load_file(path)
    targets = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    expected = model.state_dict().keys()
    if saved.keys() != set(expected):
        missing, extra = sorted(set(expected) - saved.keys()), sorted(saved.keys() - set(expected))
        raise CheckpointError(f"checkpoint file '{path}' does not match the model (missing {missing[:3]}, "
                              f"unexpected {extra[:3]})")
    for name, value in saved.items():
        local = _local(targets[name])
        if local.shape != value.shape:
            raise CheckpointError(f"checkpoint file '{path}': tensor '{name}' has shape {tuple(value.shape)}, "
                                  f"this rank's shard is {tuple(local.shape)}")
        local.copy_(value)


def merge_model_shards(directory: str) -> dict[str, torch.Tensor]:
    """The whole model state dict of an FSDP2 checkpoint, from its per-rank safetensors (on one process).

    Example:
        >>> state = merge_model_shards("outputs/run/checkpoint-100")  # doctest: +SKIP
        >>> model.load_state_dict(state)                              # doctest: +SKIP
    """
    from safetensors import safe_open

    files = sorted(Path(directory).glob("model.rank*-of-*.safetensors"),
                   key=lambda p: int(p.name.split(".rank")[1].split("-of-")[0]))
    if not files:
        raise CheckpointError(f"checkpoint '{directory}' has no model.rank<r>-of-<N>.safetensors (not an FSDP2 checkpoint)")
    parts: dict[str, list[torch.Tensor]] = {}
    sharded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as fh:
            sharded.update(json.loads((fh.metadata() or {}).get("sharded", "[]")))
            for name in fh.keys():
                parts.setdefault(name, []).append(fh.get_tensor(name))
    return {name: torch.cat(ts, dim=0) if name in sharded else ts[0] for name, ts in parts.items()}
