"""``NeuTrainer`` under DeepSpeed ZeRO-3: the engine built without an optimizer, fused updates on partitions.

``transformers.Trainer`` hands its optimizer to ``deepspeed.initialize`` as a ZeRO
"client optimizer" (``deepspeed_init`` then ``accelerator.prepare(model,
optimizer)``); DeepSpeed then keeps fp32 gradient partitions for a ``step()`` that
must do the work, and Accelerate's ``backward`` goes through ``engine.backward``:
the fused path would be bypassed (docs/trainer.md §4). :func:`prepare_for_training`
replaces that part of the Trainer's preparation for fused optimizers:

1. the DeepSpeed config is finalised from the ``TrainingArguments`` as the
   Trainer does (``auto`` values), and checked: stage 3, no ``optimizer`` or
   ``scheduler`` section (the fused optimizer and the Trainer's scheduler take
   their place);
2. the fused optimizer is built over the whole parameters, then
   ``accelerator.prepare(model)`` alone builds the engine: **no optimizer**, so
   ZeRO-3 only partitions parameters and gathers them around each module
   (``DeepSpeedZeRoOffload``);
3. the optimizer is re-bound to the partitioned parameters
   (:func:`neutrain.distributed.deepspeed.initialize_zero3` does the same for
   user loops), and the Trainer's scheduler is created on it.

Training steps run the forward through ``engine.module`` and backward through
:func:`neutrain.distributed.deepspeed.backward`.

Checkpoints: the Trainer's ``save_model`` writes the full consolidated weights
(``model.safetensors``, via ``stage3_gather_16bit_weights_on_model_save``), and
every rank writes its own partitions and optimizer state
(:func:`save_zero3_state`). Resume loads them back (:func:`load_zero3_state`),
so a checkpoint written with N processes resumes with N processes, bit for bit.
The same holds for ZeRO-3 with DeepSpeed's own optimizer (an ordinary ``adamw``):
its state is written without DeepSpeed's pickles (:func:`save_client_optimizer`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from neutrain.errors import CheckpointError, UserInputError

logger = logging.getLogger("neutrain")

# Why DeepSpeed's own checkpoints are not resumed: engine.save_checkpoint writes global_step<N>/*_model_states.pt
# and *_optim_states.pt, pickles of engine and optimizer objects (loss scaler, config) that only a full unpickle reads.
CLIENT_OPTIMIZER_PICKLE = ("DeepSpeed's own checkpoint (global_step*/*_optim_states.pt, written by DeepSpeed's "
                           "save_checkpoint) is a pickle, and neutrain never loads one. For resumable checkpoints use "
                           "ZeRO-3 (launch/deepspeed_zero3.json or deepspeed_zero3_fused.json: neutrain writes their "
                           "state as safetensors) or train.distributed: fsdp2")


def is_engine_checkpoint(checkpoint: str | os.PathLike) -> bool:
    """Whether ``checkpoint`` holds DeepSpeed's own ``save_checkpoint`` files (a ``latest`` tag, ``global_step*/``)."""
    checkpoint = Path(checkpoint)
    return (checkpoint / "latest").is_file() or any(p.is_dir() for p in checkpoint.glob("global_step*"))


def refuse_client_optimizer_resume(checkpoint: str | os.PathLike) -> None:
    """Refuse to resume ZeRO-1/2 with DeepSpeed's own optimizer: its state is a pickle (:data:`CLIENT_OPTIMIZER_PICKLE`).

    Raises:
        CheckpointError: always, naming the checkpoint, the reason and what to do.
    """
    raise CheckpointError(f"train.resume_from_checkpoint: '{checkpoint}' cannot be resumed under DeepSpeed ZeRO-1/2 "
                          f"with an ordinary optimizer (DeepSpeed's own): {CLIENT_OPTIMIZER_PICKLE}")


def warn_client_optimizer(args) -> None:
    """At the start of a ZeRO-1/2 run with DeepSpeed's own optimizer: its checkpoints will not resume (say so now)."""
    if args.save_strategy != "no" and args.process_index == 0:
        logger.warning("DeepSpeed ZeRO-1/2 with an ordinary optimizer (DeepSpeed's own): neutrain will refuse to "
                       "resume this run's checkpoints (their model.safetensors holds the full weights). %s",
                       CLIENT_OPTIMIZER_PICKLE)


def partition_file(directory: str, rank: int, world_size: int) -> str:
    """Where rank ``rank`` of ``world_size`` keeps its ZeRO-3 parameter partitions in a checkpoint."""
    return os.path.join(directory, f"zero3_partitions.rank{rank}-of-{world_size}.safetensors")


def prepare_for_training(trainer, max_steps: int, train_dataloader, resume_from_checkpoint):
    """``Trainer._prepare_for_training`` for a fused optimizer under DeepSpeed ZeRO-3.

    Args:
        trainer: the :class:`~neutrain.trainer.trainer.NeuTrainer` (its ``distributed_mode`` a fused :class:`~neutrain.distributed.modes.ZeRO3`).
        max_steps: optimizer steps of the run (for the scheduler and the config's ``auto`` values).
        train_dataloader: the prepared training dataloader (returned unchanged).
        resume_from_checkpoint: a checkpoint directory written by this mode, or None.

    Returns:
        ``(engine, train_dataloader)``, as the Trainer's own preparation does.
    """
    from neutrain.distributed.deepspeed import bind_partitions, check_fused_config, zero3_config

    accelerator, args = trainer.accelerator, trainer.args
    hf_config = accelerator.state.deepspeed_plugin.hf_ds_config
    hf_config.trainer_config_finalize(args, trainer.model, max_steps)
    if trainer.lr_scheduler is not None and getattr(trainer, "_created_lr_scheduler", False):
        trainer.lr_scheduler, trainer._created_lr_scheduler = None, False
    trainer.create_optimizer()
    optimizer = trainer.fused_optimizer
    check_fused_config(hf_config.config, optimizer, "train.deepspeed")
    hf_config.config.update(zero3_config(hf_config.config, trainer.model))
    engine = accelerator.prepare(trainer.model)  # the model alone: an engine without an optimizer
    bind_partitions(optimizer, engine)
    trainer.create_scheduler(num_training_steps=max_steps, optimizer=optimizer)
    trainer.model_wrapped = trainer.deepspeed = engine
    if resume_from_checkpoint is not None:
        load_zero3_state(trainer, resume_from_checkpoint)
    for attr in ("model", "optimizer", "lr_scheduler"):
        setattr(trainer.callback_handler, attr, getattr(trainer, attr))
    trainer.callback_handler.train_dataloader = train_dataloader
    return engine, train_dataloader


def save_zero3_state(trainer, output_dir: str) -> None:
    """Write this rank's partitions and optimizer state (fused, or DeepSpeed's own), and (main process) the scheduler.

    Plain writes: ``NeuTrainer`` writes the whole checkpoint into a temporary directory and renames it.
    """
    from safetensors.torch import save_file

    from neutrain.distributed.fsdp import optimizer_shard_file, save_optimizer_shard

    rank, world = trainer.args.process_index, trainer.args.world_size
    os.makedirs(output_dir, exist_ok=True)  # the main process may not have created it yet
    engine = trainer.model_wrapped
    partitions = {name: p.ds_tensor.detach().cpu().contiguous().clone() for name, p in engine.module.named_parameters()}
    save_file(partitions, partition_file(output_dir, rank, world), metadata={"format": "neutrain-zero3-partitions"})
    if trainer.fused:
        save_optimizer_shard(trainer.fused_optimizer, output_dir, rank, world)
    else:
        save_client_optimizer(engine, optimizer_shard_file(output_dir, rank, world))
    if trainer.args.should_save:
        torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))


@torch.no_grad()
def load_zero3_state(trainer, checkpoint: str) -> None:
    """Load what :func:`save_zero3_state` wrote, into the engine's partitions (same process count)."""
    from safetensors.torch import load_file

    from neutrain.distributed.fsdp import load_optimizer_shard, optimizer_shard_file

    rank, world = trainer.args.process_index, trainer.args.world_size
    path = partition_file(checkpoint, rank, world)
    if not os.path.isfile(path):
        raise UserInputError(
            f"train.resume_from_checkpoint: {path} not found. A DeepSpeed ZeRO-3 checkpoint resumes with the number "
            f"of processes that wrote it (this run has {world}); its model.safetensors holds the full weights."
        )
    saved = load_file(path)
    engine = trainer.model_wrapped
    params = dict(engine.module.named_parameters())
    if saved.keys() != params.keys():
        missing, extra = sorted(params.keys() - saved.keys()), sorted(saved.keys() - params.keys())
        raise UserInputError(f"{path}: partitions do not match the model (missing {missing[:3]}, unexpected {extra[:3]})")
    for name, p in params.items():
        if saved[name].shape != p.ds_tensor.shape:
            raise UserInputError(f"{path}: partition of {name} has shape {tuple(saved[name].shape)}, "
                                 f"expected {tuple(p.ds_tensor.shape)}")
        p.ds_tensor.copy_(saved[name])
    # Gathered copies (prefetched or persistent) predate the load: drop them.
    engine.optimizer.empty_partition_cache()
    if not trainer.fused:  # DeepSpeed's optimizer steps fp32 master partitions: start them from the loaded weights
        engine.optimizer.refresh_fp32_params()
    if trainer.reset_optimizer_on_resume(checkpoint):
        return
    if trainer.fused:
        load_optimizer_shard(trainer.fused_optimizer, checkpoint, rank, world)
    else:
        load_client_optimizer(engine, optimizer_shard_file(checkpoint, rank, world))
    trainer.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, "scheduler.pt"), weights_only=True))


# DeepSpeed's ZeRO-3 optimizer state, as its save_checkpoint keeps it, less the pickled objects: the engine's step
# counters and the loss scaler's numbers are JSON, the fp32 master partitions and the moments tensors.
ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")
CLIENT_KIND = "DeepSpeedZeroOptimizer_Stage3"


def save_client_optimizer(engine, path: str) -> str:
    """Write this rank's ZeRO-3 optimizer state (DeepSpeed's own optimizer) without a pickle; returns ``path``."""
    from neutrain.distributed.state_files import save_state

    state = dict(engine.optimizer.state_dict())
    scaler = state.pop("loss_scaler")
    state["loss_scaler"] = {k: v for k, v in vars(scaler).items() if v is None or isinstance(v, (bool, int, float))}
    state["engine"] = {name: int(getattr(engine, name)) for name in ENGINE_COUNTERS}
    return save_state(state, path, CLIENT_KIND)


def load_client_optimizer(engine, path: str) -> None:
    """Load what :func:`save_client_optimizer` wrote into the engine's ZeRO-3 optimizer (same process count)."""
    import torch.distributed as dist

    from neutrain.distributed.state_files import check_kind, read_optimizer_state

    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file '{path}' is missing: a DeepSpeed ZeRO-3 checkpoint resumes with the "
                              f"number of processes that wrote it")
    state, _, meta = read_optimizer_state(path)
    check_kind(meta, type(engine.optimizer).__name__, path)
    try:
        scaler, counters = state.pop("loss_scaler"), state.pop("engine")
        for name, value in scaler.items():
            setattr(engine.optimizer.loss_scaler, name, value)
        state["loss_scaler"] = engine.optimizer.loss_scaler
        # DeepSpeed's public loader takes every rank's state and picks this rank's: the others are never read.
        engine.optimizer.load_state_dict([state] * dist.get_world_size(), load_optimizer_states=True)
    except (KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint file '{path}': ZeRO-3 optimizer state does not match this run ({exc!r})") from None
    for name in ENGINE_COUNTERS:
        setattr(engine, name, int(counters[name]))
