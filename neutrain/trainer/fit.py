"""The automatic fit: the cheapest memory configuration whose every phase fits the device budget.

Why: a user with a 12 GB card should not have to know which of the 8B's weights must live in host
memory for it to train there. Before anything is built, :func:`choose_fit` predicts every phase of the
run (:mod:`neutrain.trainer.phase_planner`) for each configuration, cheapest first, and keeps the first
whose predicted peak reserved bytes fit the budget (leaving :data:`FIT_HEADROOM` of it) and whose pinned
host bytes fit the host.

The levers, from none to all:

* ``memory.offload_activations`` (checkpointed layers' inputs in host memory; needs
  ``memory.gradient_checkpointing``);
* ``memory.offload_weights`` with ``memory.offload_layers: k``: k decoder layers in host memory, spread
  between resident ones (:class:`~neutrain.nn.weight_offload_model.LayerPlacement`), the others trained
  on the GPU as before; k runs from the fewest that save anything (more layers than the store's slots)
  to every layer; NeuZip-lossless, a fused optimizer, no accumulation;
* both;
* then a smaller ``train.micro_batch_size`` with ``train.gradient_accumulation_steps`` raised to keep the
  rows per optimizer step (halving until one row), activations offloaded where allowed.

Cheapest means the fewest bytes a step waits for on the PCIe link (:func:`link_cost`): the activation
copies run on the compute stream, so all of them; the weight store copies on streams of its own, of
which :data:`COPY_HIDDEN_SHARE` overlapped compute where it was measured. So the fit takes the fewest
layers that fit, and activation offload only where it saves more than the layers it replaces would cost.

The embedding and lm_head are no lever: the loss decodes the lm_head whole, so its payload (0.67 GiB for
the 8B) would be on the device beside its decoded copy at the step's peak anyway; keeping both
vocabulary matrices in host memory lowers that peak by the embedding's payload alone, while a step
copies them in and out (about 3 GiB for the 8B) at its two ends, where no compute overlaps. Five spread
decoder layers (two slots) save more, 0.79 GiB, for about 0.6 GiB of waiting.

A key set explicitly (in the recipe file or on the command line, :attr:`Recipe.explicit`) keeps its
value in every configuration tried. If none fits, :class:`~neutrain.errors.RecipeError` names the
smallest budget and host memory that would (exit 2).

Example:
    >>> from neutrain.config import load_recipe
    >>> fit = choose_fit(load_recipe("llama3_8b"), budget=11 * GIB, host=64 * GIB)
    >>> fit.label, fit.changes
    ("offloading 9 of 32 decoder layers' weights", {'memory.offload_weights': True, 'memory.offload_layers': 9})
    >>> print(fit.line)  # doctest: +ELLIPSIS
    memory: offloading 9 of 32 decoder layers' weights: on the GPU it needs 12.24 GiB (phase 'train_step'), the budget is 11.00 GiB...
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from neutrain.config.schema import FUSED_OPTIMIZERS, Recipe
from neutrain.config.validate import check_weight_offload
from neutrain.errors import RecipeError
from neutrain.trainer.model_config import config_only
from neutrain.trainer.phase_planner import peak_phase, plan_recipe, predicted_gib
from neutrain.trainer.planner import CUDA_CONTEXT_BYTES, GIB, Estimate, ModelShape, estimate_recipe

COPY_HIDDEN_SHARE = 0.794
"""Share of the weight store's copy time that overlapped compute in the 8B's step with every layer
streamed (H200, batch 8 x 1024: benchmarks/results/offload.json, ``8b.offloaded.timeline.copy_hidden_share``).
Spread layers have more resident compute between them to hide behind, so for them this is a bound."""

FIT_HEADROOM = 0.05
"""Share of the budget a configuration must leave free: the budget is the allocator's hard limit, and the
planner's phases are within 6% of what the GPU measured for the 8B (tests/unit/trainer/test_phase_planner.py),
so a prediction 1% under the budget is no promise."""


def pcie_bytes(train: Estimate) -> float:
    """Bytes a training step moves over PCIe: the weight store's both ways, the activations out and back.

    Example:
        >>> from neutrain.config import load_recipe
        >>> from neutrain.trainer.planner import estimate_recipe
        >>> est = estimate_recipe(load_recipe("llama3_8b", ["memory.offload_weights=true", "memory.offload_layers=8"]))
        >>> round(pcie_bytes(est) / GIB, 2)  # 12 layers in (two stay in the slots at each turn), 8 out
        5.53
    """
    s = train.settings
    return s.get("h2d_bytes_per_step", 0) + s.get("d2h_bytes_per_step", 0) + 2 * s.get("host_activation_bytes", 0)


def link_cost(train: Estimate) -> float:
    """Bytes over PCIe a training step waits for (the fit's ordering; see the module docstring).

    Example:
        >>> from neutrain.config import load_recipe
        >>> from neutrain.trainer.planner import estimate_recipe
        >>> acts = estimate_recipe(load_recipe("llama3_8b", ["memory.offload_activations=true"]))
        >>> link_cost(acts) / GIB  # 32 layers x 1024 tokens x 4096 x 2 bytes, out and back in
        0.5
    """
    s = train.settings
    weights = s.get("h2d_bytes_per_step", 0) + s.get("d2h_bytes_per_step", 0)
    return 2 * s.get("host_activation_bytes", 0) + (1 - COPY_HIDDEN_SHARE) * weights


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

    @property
    def link_bytes(self) -> float:
        """:func:`link_cost` of its training step."""
        return link_cost(self.plan["train_step"])

    def fits(self, budget: int | None, host: int | None) -> bool:
        """Its peak phase leaves :data:`FIT_HEADROOM` of ``budget``, and ``host`` holds its pinned bytes."""
        return ((budget is None or self.peak[1].reserved <= budget * (1 - FIT_HEADROOM))
                and (host is None or self.host_bytes <= host))

    def as_dict(self) -> dict[str, Any]:
        """What ``summary.json`` records as ``memory_fit``."""
        name, worst = self.peak
        train = self.plan["train_step"]
        return {"choice": self.label, "changes": self.changes, "line": self.line,
                "budget_gib": None if self.budget is None else self.budget / GIB,
                "peak_phase": name, "predicted_reserved_gib": worst.reserved / GIB,
                "predicted_device_gib": worst.device / GIB, "host_gib": self.host_bytes / GIB,
                "offloaded_layers": list(train.settings.get("offloaded", ())),
                "pcie_gib_per_step": pcie_bytes(train) / GIB, "link_cost_gib": self.link_bytes / GIB,
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
    elif m.offload_layers is not None:
        return False
    return True


def placement_label(recipe: Recipe, layers: int) -> str:
    """What a configuration keeps in host memory, in words (the fit's one line and ``memory_fit.choice``).

    Example:
        >>> from neutrain.config import load_recipe
        >>> placement_label(load_recipe("llama3_8b", ["memory.offload_weights=true", "memory.offload_layers=8"]), 32)
        "offloading 8 of 32 decoder layers' weights"
    """
    m = recipe.memory
    if not m.offload_weights:
        return "offloading activations" if m.offload_activations else "on the GPU"
    if m.offload_layers is None or m.offload_layers >= layers:
        return "offloading weights and activations" if m.offload_activations else "offloading weights"
    part = f"{m.offload_layers} of {layers} decoder layers' weights"
    return f"offloading activations and {part}" if m.offload_activations else f"offloading {part}"


def _layer_counts(layers: int) -> list[int | None]:
    """``memory.offload_layers`` values worth trying: those that free more than their slots take, then all."""
    from neutrain.nn.weight_offload_model import LayerPlacement  # lazy: torch, only when a budget is fitted

    counts = [k for k in range(1, layers)
              if k > min(LayerPlacement.spread(layers, k).slots, k) * (1 + 1 / 16)]
    return [*counts, None]


def _value(recipe: Recipe, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(recipe, section), key)


@dataclass
class _Candidate:
    label: str
    changes: dict[str, Any]
    recipe: Recipe
    train: Estimate


def _ranked(recipe: Recipe, shape: ModelShape, gpu: bool) -> list[_Candidate]:
    """The configurations to try, cheapest first (see the module docstring); explicit keys are left out
    of the changes, and configurations the explicit keys make the same are tried once."""
    none = {"memory.offload_activations": False, "memory.offload_weights": False, "memory.offload_layers": None}
    offload = [none]
    if gpu:
        offload.append({**none, "memory.offload_activations": True})
        offload += [{"memory.offload_activations": act, "memory.offload_weights": True, "memory.offload_layers": k}
                    for act in (False, True) for k in _layer_counts(shape.layers)]
    seen: set[tuple] = set()

    def take(changes: dict[str, Any], prefix: str = "") -> _Candidate | None:
        changes = {k: v for k, v in changes.items() if k not in recipe.explicit}
        chosen = apply_changes(recipe, changes)
        m, t = chosen.memory, chosen.train
        layers = m.offload_layers if m.offload_layers is not None and m.offload_layers < shape.layers else None
        key = (m.offload_activations, m.offload_weights, layers if m.offload_weights else None,
               t.micro_batch_size, t.gradient_accumulation_steps)
        if not _valid(chosen) or key in seen:
            return None
        seen.add(key)
        changes = {k: v for k, v in changes.items() if v != _value(recipe, k)}  # what it really changes
        return _Candidate(prefix + placement_label(chosen, shape.layers), changes, chosen, estimate_recipe(chosen, shape))

    ranked = sorted((c for c in map(take, offload) if c is not None), key=lambda c: link_cost(c.train))
    t = recipe.train
    rows = t.micro_batch_size * t.gradient_accumulation_steps
    mb = t.micro_batch_size
    # Both keys change together (the rows per step stay): either one set by the user rules this out.
    batch_keys_free = not {"train.micro_batch_size", "train.gradient_accumulation_steps"} & recipe.explicit
    while batch_keys_free and mb > 1 and mb % 2 == 0:
        mb //= 2
        for changes in offload[:2]:  # weight offload does not accumulate
            batch = {"train.micro_batch_size": mb, "train.gradient_accumulation_steps": rows // mb}
            prefix = f"micro_batch_size {mb} x {rows // mb} accumulation steps ({rows} rows a step), "
            ranked += [c for c in [take({**changes, **batch}, prefix)] if c is not None]
    return ranked


def candidates(recipe: Recipe, gpu: bool = True) -> list[tuple[str, dict[str, Any]]]:
    """The configurations to try, cheapest first, as (label, changes); explicit keys are left out of the changes.

    On CPU (``gpu=False``) nothing is offloaded (host and device memory are one).
    """
    shape = ModelShape.from_config(config_only(recipe.model))
    return [(c.label, c.changes) for c in _ranked(recipe, shape, gpu)]


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
    shape = ModelShape.from_config(config_only(recipe.model))
    if budget is None:
        plan = plan_recipe(recipe, shape=shape)
        fit = Fit("as configured", {}, plan, _host_bytes(plan))
        fit.line = "memory: no device budget (memory.device_budget_gib: none), the recipe's configuration as it is"
        return fit
    tried: list[Fit] = []
    for candidate in _ranked(recipe, shape, gpu):
        plan = plan_recipe(candidate.recipe, candidate.train, shape)
        fit = Fit(candidate.label, candidate.changes, plan, _host_bytes(plan), budget)
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
            f"({smallest.label}) needs a budget of {_gib(worst.reserved / (1 - FIT_HEADROOM))} (phase '{name}', "
            f"{_gib(worst.reserved)} predicted){hosted}; use a larger "
            "card or budget, a host with more memory, or a smaller data.sequence_len or train.micro_batch_size")
    fit.tried = [{"choice": f.label, "peak_phase": f.peak[0], "predicted_reserved_gib": f.peak[1].reserved / GIB,
                  "host_gib": f.host_bytes / GIB, "link_cost_gib": f.link_bytes / GIB,
                  "fits": f.fits(budget, host)} for f in tried]
    name, worst = fit.peak
    where = "on the GPU" if gpu else "(CPU: recorded, not enforced)"
    if fit is tried[0]:
        fit.line = (f"memory: fits the {_gib(budget)} budget {where} (predicted peak {_gib(worst.reserved)} "
                    f"reserved in phase '{name}', {_gib(worst.device)} device)")
    else:
        first_name, first = tried[0].peak
        why = (f"on the GPU it needs {_gib(first.reserved)} (phase '{first_name}')"
               if first.reserved > budget * (1 - FIT_HEADROOM)
               else f"on the GPU it needs {_gib(tried[0].host_bytes)} of host memory")
        pcie = pcie_bytes(fit.plan["train_step"])
        fit.line = (f"memory: {fit.label}: {why}, the budget is {_gib(budget)}; predicted peak "
                    f"{_gib(worst.reserved)} reserved in phase '{name}'"
                    + (f", {_gib(fit.host_bytes)} of host memory" if fit.host_bytes else "")
                    + (f", {_gib(pcie)} over PCIe a step" if pcie else ""))
    return fit
