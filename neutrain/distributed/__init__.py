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

:func:`~neutrain.distributed.modes.choose_mode` names the mode of a prepared ``Accelerator``: one
object per mode (:mod:`~neutrain.distributed.modes`), whose methods the Trainer and the run call.
"""

from __future__ import annotations


def resume_files(mode, rank: int, world_size: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(model files, optimizer and schedule files)`` rank ``rank`` reads from a checkpoint of ``mode``.

    ``mode`` is a :class:`~neutrain.distributed.modes.DistributedMode` or its name (a summary's
    ``distributed_mode``; None for an ordinary optimizer on whole weights). The model files are always
    required; the others only unless the optimizer is reset on purpose (``train.resume_reset_optimizer``).
    Empty model files mean "whatever weights file the Trainer finds" (model.safetensors, its index, or
    adapter_model.safetensors).

    Example:
        >>> resume_files("fsdp2", 1, 2)
        (('model.rank1-of-2.safetensors',), ('optimizer.rank1-of-2.safetensors', 'scheduler.pt'))
    """
    # lazy: modes imports neutrain.nn, whose optimizer imports distributed.shards, which runs this __init__ first
    from neutrain.distributed.modes import mode_named

    return mode_named(mode).resume_files(rank, world_size)


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
