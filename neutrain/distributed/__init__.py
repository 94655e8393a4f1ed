"""Fused-update training on several processes, on the engines users already run.

neutrain has no distributed runtime of its own: ``accelerate launch`` starts the
processes and picks the engine (``launch/``), and this package makes fused
updates correct under each of them (docs/trainer.md §2, §4):

* :mod:`~neutrain.distributed.data_parallel`: replicated weights without DDP;
  every gradient is averaged by its own asynchronous all-reduce inside the
  update (no gradient buckets);
* :mod:`~neutrain.distributed.fsdp`: FSDP2 (``fully_shard``); the update runs
  on each rank's shard in post-accumulate-grad hooks bound after Accelerate
  shards the model;
* :mod:`~neutrain.distributed.deepspeed`: DeepSpeed ZeRO-3 with the engine built
  without an optimizer.

:func:`fused_mode` names the mode of a prepared ``Accelerator``.
"""

from __future__ import annotations

MODES = ("single", "replicated", "fsdp2", "deepspeed")


def fused_mode(accelerator) -> str:
    """Which fused-update mode an ``Accelerator`` implies.

    Returns one of :data:`MODES`: ``"deepspeed"`` under DeepSpeed, ``"fsdp2"``
    under FSDP with ``fsdp_version: 2``, ``"replicated"`` for any other
    multi-process run (Accelerate's MULTI_GPU / MULTI_CPU, which would wrap the
    model in DDP), else ``"single"``.

    Raises:
        ValueError: for FSDP1, whose flat parameters are not the unit a fused
            update works on.

    Example:
        >>> from accelerate import Accelerator
        >>> fused_mode(Accelerator(cpu=True))
        'single'
    """
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        return "deepspeed"
    if kind == DistributedType.FSDP:
        if getattr(accelerator.state.fsdp_plugin, "fsdp_version", 1) != 2:
            raise ValueError(
                "fused updates need FSDP2 (fsdp_version: 2): FSDP1 flattens parameters, so no hook sees a "
                "whole parameter's shard. Use launch/fsdp2.yaml."
            )
        return "fsdp2"
    if accelerator.num_processes > 1:
        return "replicated"
    return "single"


def resume_files(mode: str | None, rank: int, world_size: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(model files, optimizer and schedule files)`` rank ``rank`` reads from a checkpoint of ``mode``.

    The model files are always required; the others only unless the optimizer is reset on purpose
    (``train.resume_reset_optimizer``). Empty model files mean "whatever weights file the Trainer finds"
    (model.safetensors, its index, or adapter_model.safetensors).

    Example:
        >>> resume_files("fsdp2", 1, 2)
        (('model.rank1-of-2.safetensors',), ('optimizer.rank1-of-2.safetensors', 'scheduler.pt'))
    """
    from neutrain.distributed.deepspeed_trainer import partition_file
    from neutrain.distributed.fsdp import model_shard_file, optimizer_shard_file

    if mode in ("fsdp2", "deepspeed"):
        model = (model_shard_file if mode == "fsdp2" else partition_file)("", rank, world_size)
        return (model,), (optimizer_shard_file("", rank, world_size), "scheduler.pt")
    return (), ("optimizer.pt", "scheduler.pt")


def sharded_mode(accelerator) -> str | None:
    """``"fsdp2"`` or ``"deepspeed"`` (ZeRO-3) when an ordinary (not fused) optimizer trains sharded weights, else None.

    NeuTrainer saves and resumes FSDP2 runs itself (per-rank safetensors) instead of through
    Accelerate's pickled DCP files; ZeRO-3 marks the weights as partitioned (gathered for the export).

    Example:
        >>> from accelerate import Accelerator
        >>> sharded_mode(Accelerator(cpu=True)) is None
        True
    """
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        return "deepspeed" if accelerator.state.deepspeed_plugin.hf_ds_config.is_zero3() else None
    if kind == DistributedType.FSDP and getattr(accelerator.state.fsdp_plugin, "fsdp_version", 1) == 2:
        return "fsdp2"
    return None


def end_processes(optimizer=None) -> None:
    """Finish every reduction in flight, wait for all processes, then destroy the process group.

    Why: left to interpreter exit, gloo's worker threads outlive Python. A worker that
    drops the last reference to a tensor Python had handed it (an all-reduce's gradient)
    must take the GIL; during finalization CPython ends such a thread with
    ``pthread_exit``, whose unwinding through a C++ destructor aborts the process:
    "terminate called without an active exception". Destroying the group first joins
    those threads while the interpreter is whole. The barrier keeps a fast rank from
    tearing its side down while the main process still writes (summary, export).

    Args:
        optimizer: the fused optimizer (or None); its pending all-reduces are drained first.

    Example:
        >>> summary = train_from_recipe(recipe)  # doctest: +SKIP
    """
    import torch.distributed as dist

    sync = getattr(optimizer, "grad_sync", None)
    if sync is not None:
        sync.drain()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_rank(code: int = 0):
    """End a finished process of a multi-process run without Python's interpreter finalization.

    Why: a native thread that takes the GIL while the interpreter finalizes is ended by
    CPython with ``pthread_exit``; where its stack crosses a C++ ``noexcept`` frame (gloo's
    ``~AsyncWork``, seen in a backtrace) the process aborts with "terminate called without
    an active exception", turning a finished run into a failed rank. Destroying the process
    group (:func:`end_processes`) does not always free it (other C++ owners keep its worker
    threads alive), so a finished rank flushes its logs and streams and leaves with
    ``os._exit``. Call it only after every file of the run is written and closed.

    Example:
        >>> summary = train_from_recipe(recipe)  # doctest: +SKIP
        >>> if summary["world_size"] > 1:  # doctest: +SKIP
        ...     exit_rank(0)
    """
    import logging
    import os
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
