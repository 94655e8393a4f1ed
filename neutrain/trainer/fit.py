"""The automatic fit: the fastest memory configuration whose every phase fits the device budget.

Why: a user with a 12 GB card should not have to know that the 8B trains there only with its
weights in host memory. Before anything is built, :func:`choose_fit` walks the
configurations from the fastest to the slowest and keeps the first one whose predicted peak
reserved bytes, over all the phases of the run (:mod:`neutrain.trainer.phase_planner`), fit the
budget, and whose pinned host bytes fit the host:

1. fully on the GPU;
2. ``memory.offload_activations`` (checkpointed layers' inputs in host memory; needs
   ``memory.gradient_checkpointing``): 0.95-1.0x of the speed on the GPU;
3. ``memory.offload_weights`` with activation offload: 0.952x for the 8B at batch 8 x 1024 on an
   H100; NeuZip-lossless, a fused optimizer, no accumulation;
4. a smaller ``train.micro_batch_size`` with ``train.gradient_accumulation_steps`` raised to keep the
   rows per optimizer step (halving until one row), activations offloaded where allowed.

A key set explicitly (in the recipe file or on the command line, :attr:`Recipe.explicit`) keeps its
value in every configuration tried. If none fits, :class:`~neutrain.errors.RecipeError` names the
smallest budget and host memory that would (exit 2).

Example:
    >>> from neutrain.config import load_recipe
    >>> fit = choose_fit(load_recipe("llama3_8b"), budget=7 * GIB, host=64 * GIB)
    >>> fit.label, fit.changes
    ('offloading weights and activations', {'memory.offload_activations': True, 'memory.offload_weights': True})
    >>> print(fit.line)  # doctest: +ELLIPSIS
    memory: offloading weights and activations: on the GPU it needs 13.21 GiB (phase 'build'), the budget is 7.00 GiB...
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from neutrain.config.schema import FUSED_OPTIMIZERS, Recipe
from neutrain.config.validate import check_weight_offload
from neutrain.errors import RecipeError
from neutrain.trainer.phase_planner import peak_phase, plan_recipe, predicted_gib
from neutrain.trainer.planner import CUDA_CONTEXT_BYTES, GIB, Estimate

AUTO_MARGIN_BYTES = 0.5 * GIB
"""``memory.device_budget_gib: auto`` leaves this much of the card beside the CUDA context: the 0.47 GiB
the H100 showed in use before any process started (``device_used_idle_gib``,
benchmarks/results/train_memory.json), which a desktop card's display also takes."""


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


@dataclass
class Fit:
    """A configuration tried (or chosen): the recipe keys it changes and its predicted phases."""

    label: str
    changes: dict[str, Any]
    plan: dict[str, Estimate]
    host_bytes: float
    budget: int | None = None
    line: str = ""
    tried: list[dict[str, Any]] = field(default_factory=list)

    @property
    def peak(self) -> tuple[str, Estimate]:
        return peak_phase(self.plan)

    def fits(self, budget: int | None, host: int | None) -> bool:
        return (budget is None or self.peak[1].reserved <= budget) and (host is None or self.host_bytes <= host)

    def as_dict(self) -> dict[str, Any]:
        """What ``summary.json`` records as ``memory_fit``."""
        name, worst = self.peak
        return {"choice": self.label, "changes": self.changes, "line": self.line,
                "budget_gib": None if self.budget is None else self.budget / GIB,
                "peak_phase": name, "predicted_reserved_gib": worst.reserved / GIB,
                "predicted_device_gib": worst.device / GIB, "host_gib": self.host_bytes / GIB,
                "phases": predicted_gib(self.plan), "tried": self.tried}


def _host_bytes(plan: dict[str, Estimate]) -> float:
    s = plan["train_step"].settings
    return s.get("host_pinned_bytes", 0) + s.get("host_activation_bytes", 0)


def apply_changes(recipe: Recipe, changes: dict[str, Any]) -> Recipe:
    """The recipe with ``{"section.key": value}`` changed (sections are frozen: new ones are made)."""
    by_section: dict[str, dict[str, Any]] = {}
    for dotted, value in changes.items():
        section, key = dotted.split(".")
        by_section.setdefault(section, {})[key] = value
    return dataclasses.replace(recipe, **{s: dataclasses.replace(getattr(recipe, s), **kv)
                                          for s, kv in by_section.items()})


def _valid(recipe: Recipe) -> bool:
    m, t = recipe.memory, recipe.train
    if m.offload_activations and not m.gradient_checkpointing:
        return False
    if m.offload_weights:
        try:
            check_weight_offload(m, t, t.optimizer in FUSED_OPTIMIZERS)
        except RecipeError:
            return False
    return True


def candidates(recipe: Recipe, gpu: bool = True) -> list[tuple[str, dict[str, Any]]]:
    """The configurations to try, fastest first, as (label, changes); explicit keys are left out of the changes.

    On CPU (``gpu=False``) nothing is offloaded (host and device memory are one).
    """
    t = recipe.train
    offload = [("on the GPU", {"memory.offload_activations": False, "memory.offload_weights": False})]
    if gpu:
        offload += [("offloading activations", {"memory.offload_activations": True, "memory.offload_weights": False}),
                    ("offloading weights and activations",
                     {"memory.offload_activations": True, "memory.offload_weights": True}),
                    ("offloading weights", {"memory.offload_activations": False, "memory.offload_weights": True})]
    out = list(offload)
    rows = t.micro_batch_size * t.gradient_accumulation_steps
    mb = t.micro_batch_size
    # Both keys change together (the rows per step stay): either one set by the user rules this out.
    batch_keys_free = not {"train.micro_batch_size", "train.gradient_accumulation_steps"} & recipe.explicit
    while batch_keys_free and mb > 1 and mb % 2 == 0:
        mb //= 2
        for label, changes in offload[:2]:  # weight offload does not accumulate
            out.append((f"micro_batch_size {mb} x {rows // mb} accumulation steps ({rows} rows a step), {label}",
                        {**changes, "train.micro_batch_size": mb, "train.gradient_accumulation_steps": rows // mb}))
    kept = []
    for label, changes in out:
        changes = {k: v for k, v in changes.items() if k not in recipe.explicit}
        if _valid(apply_changes(recipe, changes)) and changes not in [c for _, c in kept]:
            kept.append((label, changes))
    return kept


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def choose_fit(recipe: Recipe, budget: int | None, host: int | None, gpu: bool = True) -> Fit:
    """The first of :func:`candidates` whose every phase fits ``budget`` and whose host bytes fit ``host``.

    Args:
        recipe: The validated recipe (with :attr:`Recipe.explicit`).
        budget: Device budget in bytes (None: no budget, the recipe runs as it is).
        host: Host memory available in bytes (None: unknown, not checked).
        gpu: Whether the run is on a GPU (offloading is only tried there).

    Raises:
        RecipeError: nothing fits; the message names the smallest budget and host memory that would.
    """
    if budget is None:
        plan = plan_recipe(recipe)
        fit = Fit("as configured", {}, plan, _host_bytes(plan))
        fit.line = "memory: no device budget (memory.device_budget_gib: none), the recipe's configuration as it is"
        return fit
    tried: list[Fit] = []
    for label, changes in candidates(recipe, gpu):
        plan = plan_recipe(apply_changes(recipe, changes))
        fit = Fit(label, changes, plan, _host_bytes(plan), budget)
        tried.append(fit)
        if fit.fits(budget, host):
            break
    else:
        smallest = min(tried, key=lambda f: f.peak[1].reserved)
        name, worst = smallest.peak
        hosted = f" and {_gib(smallest.host_bytes)} of host memory" if smallest.host_bytes else ""
        have = f" with {_gib(host)} of host memory available" if host is not None else ""
        raise RecipeError(
            f"memory.device_budget_gib: nothing fits a budget of {_gib(budget)}{have}: the smallest configuration "
            f"({smallest.label}) needs a budget of {_gib(worst.reserved)} (phase '{name}'){hosted}; use a larger "
            "card or budget, a host with more memory, or a smaller data.sequence_len or train.micro_batch_size")
    fit.tried = [{"choice": f.label, "peak_phase": f.peak[0], "predicted_reserved_gib": f.peak[1].reserved / GIB,
                  "host_gib": f.host_bytes / GIB, "fits": f.fits(budget, host)} for f in tried]
    name, worst = fit.peak
    where = "on the GPU" if gpu else "(CPU: recorded, not enforced)"
    if fit is tried[0]:
        fit.line = (f"memory: fits the {_gib(budget)} budget {where} (predicted peak {_gib(worst.reserved)} "
                    f"reserved in phase '{name}', {_gib(worst.device)} device)")
    else:
        first_name, first = tried[0].peak
        why = (f"on the GPU it needs {_gib(first.reserved)} (phase '{first_name}')" if first.reserved > budget
               else f"on the GPU it needs {_gib(tried[0].host_bytes)} of host memory")
        fit.line = (f"memory: {fit.label}: {why}, the budget is {_gib(budget)}; predicted peak "
                    f"{_gib(worst.reserved)} reserved in phase '{name}'"
                    + (f", {_gib(fit.host_bytes)} of host memory" if fit.host_bytes else ""))
    return fit
