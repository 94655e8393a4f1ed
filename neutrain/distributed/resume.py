"""What a resume reads, checked before it is read: every file of the mode's checkpoint layout, by name and by checksum.

The file names come from the distributed mode (:meth:`~neutrain.distributed.modes.DistributedMode.resume_files`);
the checks themselves are :mod:`neutrain.storage.manifest`'s.

Example:
    >>> from neutrain.distributed.resume import verify_resume
    >>> verify_resume("outputs/run/checkpoint-100", None, rank=0, world_size=1)  # doctest: +SKIP
"""

from __future__ import annotations

import os
from pathlib import Path

from neutrain.distributed.deepspeed_trainer import CLIENT_OPTIMIZER_PICKLE, is_engine_checkpoint
from neutrain.distributed.modes import DistributedMode, mode_named
from neutrain.errors import CheckpointError
from neutrain.storage.manifest import verify_checkpoint

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors")


def verify_resume(checkpoint: str | os.PathLike, mode: DistributedMode | str | None, rank: int, world_size: int,
                  reset_optimizer: bool = False) -> None:
    """Everything a resume of ``mode`` (a mode object or its name, see :func:`~neutrain.distributed.modes.mode_named`) reads, checked before it is read.

    A missing optimizer or scheduler file is refused unless ``reset_optimizer``
    (``train.resume_reset_optimizer``): resuming without it would silently restart the
    optimizer's moments and the learning-rate schedule.
    """
    checkpoint = Path(checkpoint)
    model_files, state_files = mode_named(mode).resume_files(rank, world_size)
    if not checkpoint.is_dir():
        raise CheckpointError(f"train.resume_from_checkpoint: '{checkpoint}' does not exist or is not a directory")
    if is_engine_checkpoint(checkpoint):  # else the first of its pickles would be named without the reason
        raise CheckpointError(f"train.resume_from_checkpoint: '{checkpoint}' was written by DeepSpeed's own "
                              f"save_checkpoint and cannot be resumed: {CLIENT_OPTIMIZER_PICKLE}")
    if not model_files and not any((checkpoint / name).is_file() for name in WEIGHT_FILES):
        raise CheckpointError(f"checkpoint file '{checkpoint / WEIGHT_FILES[0]}' is missing (no model weights in "
                              f"the checkpoint)")
    missing = [name for name in state_files if not (checkpoint / name).is_file()]
    if missing and not reset_optimizer:
        raise CheckpointError(f"checkpoint file '{checkpoint / missing[0]}' is missing: resuming without it would "
                              f"restart the optimizer and learning-rate schedule; set train.resume_reset_optimizer: "
                              f"true to do that on purpose")
    verify_checkpoint(checkpoint, required=("trainer_state.json", *model_files),
                      may_be_missing=state_files if reset_optimizer else ())
