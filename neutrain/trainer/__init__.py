"""The trainer: ``NeuTrainer(transformers.Trainer)`` and what it composes (model building, callbacks, run state).

Example:
    >>> from neutrain.trainer import NeuTrainer  # doctest: +SKIP
"""

from neutrain.compat.deepspeed_env import name_cpu_accelerator

# Before transformers' Trainer can import DeepSpeed: on a machine without a GPU, DeepSpeed's accelerator
# detection printed a warning into every script that used NeuTrainer from Python (the CLI names it itself).
name_cpu_accelerator()

from neutrain.trainer.trainer import NeuTrainer  # noqa: E402

__all__ = ["NeuTrainer"]
