"""The trainer: ``NeuTrainer(transformers.Trainer)`` and what it composes (model building, callbacks, run state).

Example:
    >>> from neutrain.trainer import NeuTrainer  # doctest: +SKIP
"""

from neutrain.trainer.trainer import NeuTrainer

__all__ = ["NeuTrainer"]
