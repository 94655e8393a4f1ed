"""The device budget: what ``memory.device_budget_gib`` resolves to on a card, and the allocator's hard limit.

Why one module: training (:func:`neutrain.memory.fit.choose_fit`) and generation
(:mod:`neutrain.memory.residency`) fit their placement to the same budget, and both hold the process to it
the same way, so a promise made by the planner is kept by the allocator or the command ends in one line.
"""

from __future__ import annotations

import logging

from neutrain.memory.planner import CUDA_CONTEXT_BYTES, GIB

logger = logging.getLogger("neutrain")


AUTO_MARGIN_BYTES = 0.5 * GIB
"""``memory.device_budget_gib: auto`` leaves this much of the card beside the CUDA context: the 0.47 GiB
the H100 showed in use before any process started (``device_used_idle_gib``,
benchmarks/memory/results.jsonl#train_memory), which a desktop card's display also takes."""


def auto_budget(card_total: int) -> int:
    """``auto``: the card's total memory minus the CUDA context and :data:`AUTO_MARGIN_BYTES` (bytes).

    Example:
        >>> round(auto_budget(24 * 10**9) / GIB, 2)  # a 24 GB card
        21.1
    """
    return int(card_total - CUDA_CONTEXT_BYTES - AUTO_MARGIN_BYTES)


def resolve_budget(setting: float | str, card_total: int | None) -> int | None:
    """Bytes of ``memory.device_budget_gib`` (``auto``, ``none`` or GiB) on a card of ``card_total`` bytes.

    ``auto`` without a card (CPU) is no budget; a number is a budget wherever the run is.

    Example:
        >>> resolve_budget(14.5, None) / GIB, resolve_budget("none", 80 * GIB), resolve_budget("auto", None)
        (14.5, None, None)
    """
    if setting == "none":
        return None
    if setting == "auto":
        return auto_budget(card_total) if card_total else None
    return int(float(setting) * GIB)


def enforce_budget(budget: int, device: int) -> float:
    """Cap this process's CUDA caching allocator at ``budget`` bytes on ``device``; returns the fraction set.

    ``torch.cuda.set_per_process_memory_fraction`` limits what the allocator reserves, so an
    allocation over the budget raises ``torch.OutOfMemoryError`` (named by phase at the top level)
    instead of growing into memory the budget promised to leave free.
    """
    import torch  # lazy: `neutrain --help` stays instant

    total = torch.cuda.get_device_properties(device).total_memory
    if budget > total:
        logger.warning("memory.device_budget_gib: %.2f GiB is more than this card's %.2f GiB; the card is the limit",
                       budget / 2**30, total / 2**30)
    fraction = min(1.0, budget / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    logger.info("memory.device_budget_gib: the CUDA allocator may reserve %.2f GiB (%.4f of %.2f GiB)",
                budget / 2**30, fraction, total / 2**30)
    return fraction
