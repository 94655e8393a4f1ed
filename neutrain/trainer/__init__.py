"""The trainer: ``NeuTrainer(transformers.Trainer)`` and what it composes (model building, callbacks, run state).

``NeuTrainer`` is imported on first use: the planner modules of this package (``neutrain estimate``)
must not pay for transformers' Trainer, peft and datasets, which its import brings in.

Example:
    >>> from neutrain.trainer import NeuTrainer  # doctest: +SKIP
"""

from __future__ import annotations

__all__ = ["NeuTrainer"]


def __getattr__(name: str):
    if name != "NeuTrainer":
        raise AttributeError(f"module 'neutrain.trainer' has no attribute {name!r}")
    from neutrain.trainer.trainer import NeuTrainer  # lazy: the Trainer's import is the heavy one

    globals()["NeuTrainer"] = NeuTrainer
    return NeuTrainer
