"""Perplexity from a mean loss, computed and written in one place.

Why: each place that reported a held-out perplexity computed ``exp(min(loss, 50))`` itself, so a loss of
1063 (a diverged model) printed "perplexity 5184705528587072045056.00": a number that looks measured but is
only the clamp. Here a loss past :data:`MAX_LOSS` nats gives ``inf`` (no model has a perplexity past
e^50 ~ 5e21, far beyond any vocabulary: such a loss means divergence, not a distribution), a NaN loss gives
NaN, and :func:`perplexity_text` always prints the loss beside it. A JSON record keeps ``null`` where the
perplexity is not finite (JSON has no ``Infinity``), with the loss beside it.

Example:
    >>> perplexity_text(2.0)
    'loss 2.0000, perplexity 7.39'
    >>> perplexity_text(1063.0)
    'loss 1063.0000, perplexity inf (a loss past 50 nats: the model diverged)'
"""

from __future__ import annotations

import math

MAX_LOSS = 50.0


def perplexity_of(loss: float) -> float:
    """``exp(loss)``, or ``inf`` past :data:`MAX_LOSS` nats, or NaN for a NaN loss.

    Example:
        >>> perplexity_of(0.0), perplexity_of(51.0), math.isnan(perplexity_of(float("nan")))
        (1.0, inf, True)
    """
    if math.isnan(loss):
        return math.nan
    return math.exp(loss) if loss <= MAX_LOSS else math.inf


def perplexity_record(loss: float) -> float | None:
    """The perplexity as a JSON record holds it: :func:`perplexity_of`, or None where it is not finite."""
    value = perplexity_of(loss)
    return value if math.isfinite(value) else None


def perplexity_text(loss: float) -> str:
    """``"loss L, perplexity P"``: P with two decimals (three significant digits past a million), ``inf`` with
    the reason past :data:`MAX_LOSS`, ``nan`` for a NaN loss."""
    value = perplexity_of(loss)
    if math.isnan(value):
        shown = "nan (the loss is not a number)"
    elif math.isinf(value):
        shown = f"inf (a loss past {MAX_LOSS:g} nats: the model diverged)"
    else:
        shown = f"{value:.2f}" if value < 1e6 else f"{value:.3g}"
    return f"loss {loss:.4f}, perplexity {shown}"
