"""Settings that run but are unlikely to do what the user wants: one warning line each, before the build.

The learning rate: ``recipes/default.yaml`` trains from scratch with AdaLomo at 0.1. Copied, with
``model.base_model`` set to a pretrained model, that rate wrecks the model within a few steps (AdaLomo at
1e-2 destroyed SmolLM2-135M in 8 steps, 1e-3 already drifted: benchmarks/notes_finetune_lr.md), and nothing
said so. A pretrained model with a rate in an optimizer's from-scratch range now gets one line naming the
rate fine-tuning uses.

Example:
    >>> print(learning_rate_advice("adalomo", 0.1, pretrained="HuggingFaceTB/SmolLM2-135M"))
    train.learning_rate: 0.1 is a from-scratch rate for adalomo, and model HuggingFaceTB/SmolLM2-135M is pretrained: a
    rate this high wrecks it within a few steps; fine-tuning with adalomo uses 5e-4 (recipes/smollm2_chat.yaml;
    1e-4 to 5e-4 learn without drift); see docs/models-and-data.md, "Learning rates for fine-tuning a pretrained model"
    >>> learning_rate_advice("adalomo", 5e-4, pretrained="HuggingFaceTB/SmolLM2-135M") is None
    True
"""

from __future__ import annotations

import logging

from neutrain.config.schema import Recipe

logger = logging.getLogger("neutrain")

#: optimizer -> (the lowest from-scratch rate, what fine-tuning a pretrained model uses instead).
FINE_TUNING_RATES = {
    "adalomo": (1e-2, "5e-4 (recipes/smollm2_chat.yaml; 1e-4 to 5e-4 learn without drift)"),
    "lomo": (1e-1, "1e-3 (benchmarks/notes_finetune_lr.md)"),
    "sgd": (1e-1, "1e-3, as for lomo (benchmarks/notes_finetune_lr.md)"),
    "adamw": (1e-3, "1e-5 to 5e-5"),
    "adamw-in-backward": (1e-3, "1e-5 to 5e-5, as for adamw"),
}


def learning_rate_advice(optimizer: str, rate: float, pretrained: str | None) -> str | None:
    """The warning for a from-scratch ``rate`` on a ``pretrained`` model (its name), else None."""
    if not pretrained or optimizer not in FINE_TUNING_RATES:
        return None
    low, instead = FINE_TUNING_RATES[optimizer]
    if rate < low:
        return None
    return (f"train.learning_rate: {rate:g} is a from-scratch rate for {optimizer}, and model {pretrained} is "
            f"pretrained: a rate this high wrecks it within a few steps; fine-tuning with {optimizer} uses {instead}; "
            f"see docs/models-and-data.md, \"Learning rates for fine-tuning a pretrained model\"")


def warn_about_settings(recipe: Recipe) -> None:
    """Log the warnings of this module that apply to ``recipe`` (one line each)."""
    model = recipe.model
    # An adapter run trains new matrices beside a frozen base, which no rate can wreck.
    whole = model["init"] == "pretrained" and not recipe.memory["adapter"]
    pretrained = (model["base_model"] or model["gguf_file"]) if whole else None
    line = learning_rate_advice(recipe.train["optimizer"], recipe.train["learning_rate"], pretrained)
    if line:
        logger.warning(line)
