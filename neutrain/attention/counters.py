"""Counters that prove which attention path ran, and log-once fallback warnings.

Tests that guard the fast path assert ``counters["fallback"] == 0`` and that the
quantized path (``"kernel"`` or ``"reference"``) was counted.
"""

from __future__ import annotations

import logging
from collections import Counter

logger = logging.getLogger("neutrain.attention")

#: ``kernel``: Triton or Gluon forward launches (``kernel_gluon``: the Gluon ones); ``kernel_backward``: Triton backward launches;
#: ``reference``: pure-PyTorch quantized forwards (CPU path); ``fallback``: calls
#: routed to torch SDPA; ``fallback:<reason>``: the same, per reason.
counters: Counter = Counter()
_logged_reasons: set[str] = set()


def count(name: str, n: int = 1) -> None:
    """Add ``n`` to ``counters[name]``."""
    counters[name] += n


def record_fallback(reason: str) -> None:
    """Count a fallback to SDPA and log the reason once per process."""
    counters["fallback"] += 1
    counters[f"fallback:{reason}"] += 1
    if reason not in _logged_reasons:
        _logged_reasons.add(reason)
        logger.warning("neutrain_sage attention falls back to SDPA: %s (logged once)", reason)


def reset_counters() -> None:
    """Zero all counters (the log-once memory is kept)."""
    counters.clear()
