"""Settings that run but are unlikely to do what the user wants: one warning line each, before the build.

The learning rate: ``recipes/default.yaml`` trains from scratch with AdaLomo at 0.1. Copied, with
``model.base_model`` set to a pretrained model, that rate wrecks the model within a few steps (AdaLomo at
1e-2 destroyed SmolLM2-135M in 8 steps, 1e-3 already drifted: benchmarks/training/NOTES.md), and nothing
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
    "lomo": (1e-1, "1e-3 (benchmarks/training/NOTES.md)"),
    "sgd": (1e-1, "1e-3, as for lomo (benchmarks/training/NOTES.md)"),
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


def warmup_advice(scheduler: str, warmup: int, max_steps: int, rate: float) -> str | None:
    """The warning for a warm-up the schedule cannot carry out, else None: one the scheduler ignores
    (``constant``), or one as long as the run, so the rate never reaches ``train.learning_rate``.

    Example:
        >>> print(warmup_advice("linear", 100, 4, 3e-3))
        train.warmup_steps: 100 of a run of train.max_steps 4: the learning rate never reaches train.learning_rate
        0.003 (at most 0.00012 at the last step); lower train.warmup_steps below train.max_steps
        >>> warmup_advice("linear", 3, 4, 3e-3) is None
        True
    """
    if scheduler == "constant" and warmup > 0:
        return (f"train.lr_scheduler constant ignores train.warmup_steps ({warmup}): the rate is "
                f"train.learning_rate from the first step; use constant_with_warmup to warm up")
    if max_steps > 0 and warmup >= max_steps and scheduler != "constant":
        return (f"train.warmup_steps: {warmup} of a run of train.max_steps {max_steps}: the learning rate never reaches "
                f"train.learning_rate {rate:g} (at most {rate * max_steps / warmup:.2g} at the last step); lower "
                "train.warmup_steps below train.max_steps")
    return None


def keeping_advice(save_steps: int, max_steps: int, save_final: bool, export_format: str) -> str | None:
    """The warning for a run that writes its trained weights nowhere, else None: no checkpoint (``save_steps`` past
    ``max_steps`` and ``save_final`` off) and no export. Why: such a run trained for its whole length and then
    said, in its summary, that nothing was saved; a benchmark means it, anyone else learns it too late.

    Example:
        >>> print(keeping_advice(100, 4, False, "none"))
        train.save_steps: 100 past train.max_steps 4, train.save_final: false and export.format: none: the trained weights are written nowhere (a benchmark's setting); lower train.save_steps, set train.save_final: true or choose an export.format to keep them
        >>> keeping_advice(100, 4, True, "none") is None, keeping_advice(2, 4, False, "none") is None
        (True, True)
    """
    if save_final or export_format != "none" or max_steps <= 0 or save_steps <= max_steps:
        return None
    return (f"train.save_steps: {save_steps} past train.max_steps {max_steps}, train.save_final: false and "
            "export.format: none: the trained weights are written nowhere (a benchmark's setting); lower "
            "train.save_steps, set train.save_final: true or choose an export.format to keep them")


def warn_about_settings(recipe: Recipe) -> None:
    """Log the warnings of this module that apply to ``recipe`` (one line each)."""
    model = recipe.model
    # An adapter run trains new matrices beside a frozen base, which no rate can wreck.
    whole = model.init == "pretrained" and not recipe.memory.adapter
    pretrained = (model.base_model or model.gguf_file) if whole else None
    t = recipe.train
    for line in (learning_rate_advice(t.optimizer, t.learning_rate, pretrained),
                 warmup_advice(t.lr_scheduler, t.warmup_steps, t.max_steps, t.learning_rate),
                 keeping_advice(t.save_steps, t.max_steps, t.save_final, recipe.export.format)):
        if line:
            logger.warning(line)
