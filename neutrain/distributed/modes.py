"""One object per distributed mode: what the Trainer and the run do differently under each engine.

:func:`choose_mode` looks at the launch once (the prepared ``Accelerator``) and returns one
of these; ``NeuTrainer`` keeps it as ``distributed_mode`` and calls its methods where the
engines differ (set-up checks, gradient all-reduce, binding the fused update after
``accelerator.prepare``, backward, checkpoint files, resume, gathering weights for export):

===============  ===================  =========================================================
class            ``name``             when
===============  ===================  =========================================================
:class:`Single`      ``"single"``         fused updates, one process
:class:`Replicated`  ``"replicated"``     fused updates, several processes (no DDP: all-reduce in the update)
:class:`FSDP2`       ``"fsdp2"``          FSDP with ``fsdp_version: 2``, fused or ordinary optimizer
:class:`ZeRO3`       ``"deepspeed"``      DeepSpeed (ZeRO-3; a fused run refuses other stages by config)
:class:`Ordinary`    ``None``             an ordinary optimizer on whole weights: the Trainer's own path
                                          (one process, DDP, FSDP1, or DeepSpeed ZeRO-1/2)
===============  ===================  =========================================================

Why a fifth class: an ordinary optimizer on whole weights is not a neutrain mode at all (the
summary records ``None``), and its one check (DeepSpeed ZeRO-1/2 checkpoints are pickles)
belongs to no fused mode.

The recipe's ``train.distributed`` only chooses the launch's ``TrainingArguments``
(:mod:`neutrain.distributed.arguments`); the mode itself comes from what the launcher started.

Example:
    >>> from accelerate import Accelerator
    >>> mode = choose_mode(Accelerator(cpu=True), fused=True)
    >>> mode.name, mode.sharded, mode.resume_files(0, 1)
    ('single', False, ((), ('optimizer.pt', 'scheduler.pt')))
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from accelerate.utils import DistributedType

from neutrain.compat.accelerate_prepare import skip_ddp_wrapping
from neutrain.distributed import data_parallel, deepspeed_trainer, fsdp
from neutrain.distributed.deepspeed import backward as zero3_backward
from neutrain.errors import UserInputError
from neutrain.nn.checkpoint import is_compressed

SCHEDULER_FILE = "scheduler.pt"


class DistributedMode(Protocol):
    """What differs between engines, as the Trainer and the run ask it.

    ``trainer`` arguments are the :class:`~neutrain.trainer.trainer.NeuTrainer`; ``default`` arguments are
    the ``transformers.Trainer`` method the mode replaces, for modes that keep it.
    """

    name: str | None  # the summary's distributed_mode
    fused: bool  # the optimizer updates inside backward (neutrain.optim)
    sharded: bool  # each process holds only its shards: main-process-only work (eval, export, distill) is skipped
    export_note: str | None  # why the run cannot export (logged after "export skipped under"), or None

    def setup(self, trainer) -> None:
        """At ``NeuTrainer.__init__``: refuse settings the engine cannot run, keep Accelerate's DDP away."""

    def attach(self, optimizer, model: torch.nn.Module) -> None:
        """Once the fused optimizer exists: wire the gradient reduction it needs."""

    def bind_after_prepare(self, optimizer, model: torch.nn.Module) -> None:
        """First training step of a sharded fused run: hook the update to the parameters ``prepare`` made."""

    def prepare_for_training(self, trainer, max_steps: int, train_dataloader, checkpoint, default: Callable):
        """``Trainer._prepare_for_training``: ``(model, train_dataloader)``."""

    def loss_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module a fused step runs forward through."""

    def backward(self, model: torch.nn.Module, optimizer, loss: torch.Tensor) -> None:
        """A fused step's backward (the updates run inside it)."""

    def save_state(self, trainer, output_dir: str, default: Callable) -> None:
        """Write the optimizer, schedule (and, when sharded, model shards) into a checkpoint."""

    def load_state(self, trainer, checkpoint: str, default: Callable) -> None:
        """Read what :meth:`save_state` wrote (the optimizer and schedule)."""

    def load_model(self, trainer, checkpoint: str, model, default: Callable) -> None:
        """Read a checkpoint's weights into ``model``."""

    def check_resume(self, checkpoint: str) -> None:
        """Refuse a checkpoint this mode cannot resume, before anything is read."""

    def resume_files(self, rank: int, world_size: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """``(model files, optimizer and schedule files)`` that rank ``rank`` reads (:mod:`~neutrain.distributed.resume`)."""

    def gathered_weights(self, model: torch.nn.Module) -> ContextManager:
        """A context in which ``model`` holds its whole weights (for the export)."""


@dataclass(frozen=True)
class _TrainerPath:
    """The ``transformers.Trainer``'s own behaviour; each mode overrides where its engine differs."""

    fused: bool = True
    name = None
    sharded = False
    export_note = None

    def setup(self, trainer) -> None:
        pass

    def attach(self, optimizer, model: torch.nn.Module) -> None:
        pass

    def bind_after_prepare(self, optimizer, model: torch.nn.Module) -> None:
        pass

    def prepare_for_training(self, trainer, max_steps: int, train_dataloader, checkpoint, default: Callable):
        return default(max_steps, train_dataloader, checkpoint)

    def loss_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def backward(self, model: torch.nn.Module, optimizer, loss: torch.Tensor) -> None:
        optimizer.backward(loss)

    def save_state(self, trainer, output_dir: str, default: Callable) -> None:
        return default(output_dir)

    def load_state(self, trainer, checkpoint: str, default: Callable) -> None:
        return default(checkpoint)

    def load_model(self, trainer, checkpoint: str, model, default: Callable) -> None:
        return default(checkpoint, model)

    def check_resume(self, checkpoint: str) -> None:
        pass

    def resume_files(self, rank: int, world_size: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return (), ("optimizer.pt", SCHEDULER_FILE)

    def gathered_weights(self, model: torch.nn.Module) -> ContextManager:
        return contextlib.nullcontext()

    def _optimizer(self, trainer):
        return trainer.fused_optimizer if self.fused else trainer.optimizer

    def _check_loss_chunking(self, trainer, engine: str) -> None:
        if self.fused and trainer.memory.loss_chunk_size > 0:
            # The chunked loss reads the lm_head weight directly, past FSDP2's root unshard hook and
            # ZeRO-3's per-module gather.
            raise UserInputError(f"memory.loss_chunk_size is not supported with {engine}; set it to 0")


@dataclass(frozen=True)
class Ordinary(_TrainerPath):
    """An ordinary optimizer on whole weights: one process, DDP, FSDP1 or DeepSpeed ZeRO-1/2 (``deepspeed_client``)."""

    fused: bool = False
    deepspeed_client: bool = False  # DeepSpeed ZeRO-1/2 steps its own client optimizer

    def setup(self, trainer) -> None:
        if self.deepspeed_client:  # ZeRO-1/2 checkpoints are DeepSpeed's pickles
            deepspeed_trainer.warn_client_optimizer(trainer.args)

    def check_resume(self, checkpoint: str) -> None:
        if self.deepspeed_client:
            deepspeed_trainer.refuse_client_optimizer_resume(checkpoint)


@dataclass(frozen=True)
class Single(_TrainerPath):
    """Fused updates in one process."""

    name = "single"


@dataclass(frozen=True)
class Replicated(_TrainerPath):
    """Fused updates on whole weights in every process; each gradient is all-reduced inside the update, not by DDP."""

    name = "replicated"

    def setup(self, trainer) -> None:
        skip_ddp_wrapping(trainer.accelerator)  # gradients are averaged inside the fused update instead

    def attach(self, optimizer, model: torch.nn.Module) -> None:
        data_parallel.attach(optimizer, model)


@dataclass(frozen=True)
class FSDP2(_TrainerPath):
    """FSDP2 (``fully_shard``): checkpoints are per-rank safetensors of the model's and the optimizer's shards."""

    name = "fsdp2"
    sharded = True
    export_note = ("FSDP2: merge the last checkpoint's model.rank*-of-*.safetensors with "
                   "neutrain.distributed.fsdp.merge_model_shards, then export on one process")

    def setup(self, trainer) -> None:
        self._check_loss_chunking(trainer, "FSDP2")

    def bind_after_prepare(self, optimizer, model: torch.nn.Module) -> None:
        fsdp.bind_after_prepare(optimizer, model)

    def save_state(self, trainer, output_dir: str, default: Callable) -> None:
        # The model's shards (safetensors, not DCP's pickled metadata) and the optimizer per rank.
        rank, world = trainer.args.process_index, trainer.args.world_size
        os.makedirs(output_dir, exist_ok=True)
        fsdp.save_model_shard(trainer.model, output_dir, rank, world)
        fsdp.save_optimizer_shard(self._optimizer(trainer), output_dir, rank, world)
        if trainer.args.should_save:
            torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def load_state(self, trainer, checkpoint: str, default: Callable) -> None:
        fsdp.load_optimizer_shard(self._optimizer(trainer), checkpoint, trainer.args.process_index, trainer.args.world_size)
        trainer.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_FILE), weights_only=True))

    def load_model(self, trainer, checkpoint: str, model, default: Callable) -> None:
        return fsdp.load_model_shard(model if model is not None else trainer.model, checkpoint, trainer.args.process_index,
                              trainer.args.world_size)

    def resume_files(self, rank: int, world_size: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return (fsdp.model_shard_file("", rank, world_size),), (fsdp.optimizer_shard_file("", rank, world_size), SCHEDULER_FILE)


@dataclass(frozen=True)
class ZeRO3(_TrainerPath):
    """DeepSpeed ZeRO-3; fused runs build the engine without an optimizer (:mod:`~neutrain.distributed.deepspeed_trainer`)."""

    name = "deepspeed"
    sharded = True

    def setup(self, trainer) -> None:
        self._check_loss_chunking(trainer, "DeepSpeed ZeRO-3")
        if self.fused and is_compressed(trainer.model):
            raise UserInputError("DeepSpeed ZeRO-3 partitions dense weights only: set memory.weights: dense")

    def prepare_for_training(self, trainer, max_steps: int, train_dataloader, checkpoint, default: Callable):
        if self.fused:
            # The Trainer would hand the fused optimizer to DeepSpeed as a ZeRO client optimizer: build the engine
            # without one instead (its partitions are bound there, so bind_after_prepare has nothing left to do).
            return deepspeed_trainer.prepare_for_training(trainer, max_steps, train_dataloader, checkpoint)
        # DeepSpeed's own optimizer: resume from neutrain's files, not DeepSpeed's pickles.
        model, train_dataloader = default(max_steps, train_dataloader, None)
        if checkpoint is not None:
            deepspeed_trainer.load_zero3_state(trainer, checkpoint)
        return model, train_dataloader

    def loss_model(self, model: torch.nn.Module) -> torch.nn.Module:
        # Forward through engine.module (its gather hooks live on the modules); the engine's own
        # forward/backward pair needs an optimizer.
        return model.module

    def backward(self, model: torch.nn.Module, optimizer, loss: torch.Tensor) -> None:
        zero3_backward(model, optimizer, loss)

    def save_state(self, trainer, output_dir: str, default: Callable) -> None:
        # Every rank's partitions and optimizer state (model.safetensors is whole); loaded in prepare_for_training.
        return deepspeed_trainer.save_zero3_state(trainer, output_dir)

    def resume_files(self, rank: int, world_size: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return ((deepspeed_trainer.partition_file("", rank, world_size),),
                (fsdp.optimizer_shard_file("", rank, world_size), SCHEDULER_FILE))

    def gathered_weights(self, model: torch.nn.Module) -> ContextManager:
        import deepspeed  # lazy: an optional dependency, present only where DeepSpeed launched the run

        return deepspeed.zero.GatheredParameters(list(model.parameters()))


MODES: dict[str | None, DistributedMode] = {mode.name: mode for mode in (Ordinary(), Single(), Replicated(), FSDP2(), ZeRO3())}


def mode_named(mode: DistributedMode | str | None) -> DistributedMode:
    """The fused mode of a summary's ``distributed_mode`` name (a mode passes through; None: :class:`Ordinary`).

    Example:
        >>> mode_named("fsdp2").resume_files(1, 2)
        (('model.rank1-of-2.safetensors',), ('optimizer.rank1-of-2.safetensors', 'scheduler.pt'))
    """
    if mode is None or isinstance(mode, str):
        return MODES[mode]
    return mode


def choose_mode(accelerator: Any, fused: bool) -> DistributedMode:
    """The mode the launch implies, for a fused (``fused=True``) or an ordinary optimizer.

    DeepSpeed is :class:`ZeRO3` (an ordinary optimizer under ZeRO-1/2: :class:`Ordinary` with its client
    optimizer); FSDP with ``fsdp_version: 2`` is :class:`FSDP2`; other multi-process runs of fused updates are
    :class:`Replicated` (Accelerate would wrap the model in DDP); else :class:`Single` (fused) or :class:`Ordinary`.

    Raises:
        ValueError: fused updates under FSDP1, whose flat parameters are not the unit a fused update works on.

    Example:
        >>> from accelerate import Accelerator
        >>> choose_mode(Accelerator(cpu=True), fused=False)
        Ordinary(fused=False, deepspeed_client=False)
    """
    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        if fused or accelerator.state.deepspeed_plugin.hf_ds_config.is_zero3():
            return ZeRO3(fused=fused)
        return Ordinary(deepspeed_client=True)
    if kind == DistributedType.FSDP:
        if getattr(accelerator.state.fsdp_plugin, "fsdp_version", 1) == 2:
            return FSDP2(fused=fused)
        if fused:
            raise ValueError(
                "fused updates need FSDP2 (fsdp_version: 2): FSDP1 flattens parameters, so no hook sees a "
                "whole parameter's shard. Use launch/fsdp2.yaml."
            )
    if not fused:
        return Ordinary()
    return Replicated() if accelerator.num_processes > 1 else Single()
