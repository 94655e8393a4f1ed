"""Draft distillation: the token-level divergences and the acceptance rate a draft reaches.

The training loop that uses them is :class:`neutrain.trainer.distill.DistillationTrainer`
(a ``NeuTrainer``), so this package stays below the trainer.
"""

from neutrain.distill.losses import DIVERGENCES, acceptance_rate, token_acceptance, token_divergence

__all__ = ["DIVERGENCES", "acceptance_rate", "token_acceptance", "token_divergence"]
