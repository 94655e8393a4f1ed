"""The automatic fit: of the configurations whose every phase fits the device budget, the fastest.

Why: a user with a 12 GB card should not have to know which of the 8B's weights must live in host
memory for it to train there, and a user with a 24 GB card should not pay for compression the card does
not need. Before anything is built, :func:`choose_fit` predicts every phase of the run
(:mod:`neutrain.memory.phase_planner`) and one step's time (:mod:`neutrain.memory.step_time`) for each
configuration (:mod:`neutrain.memory.configurations`: dense or NeuZip weights, activations or k layers
in host memory, a smaller micro-batch), keeps those whose predicted peak reserved bytes fit the budget
(leaving :data:`FIT_HEADROOM` of it) and whose pinned host bytes fit the host, and takes the one with the
shortest predicted step. They all train the same model: lossless compression, offload and accumulation
change memory and speed, never a weight.

Host memory is part of the fit: a configuration that pins host memory must leave the process its own
(:data:`~neutrain.memory.tiers.HOST_PROCESS_BYTES`), and where the host cannot hold every offloaded layer input
they are split over the GPU, host memory and a file (:mod:`neutrain.memory.tiers`), which the line names.

``memory.weights: auto`` leaves the weights to the fit: dense where the run fits dense, NeuZip where it
must. With no budget (``memory.device_budget_gib: none``, or ``auto`` on a CPU) only the weights are
chosen, against the card's memory (on a CPU, the host's); the other keys stay as the recipe has them.

A key set explicitly (in the recipe file or on the command line, :attr:`Recipe.explicit`) keeps its
value in every configuration tried, ``memory.weights`` unless it says ``auto``. If none fits,
:class:`~neutrain.errors.RecipeError` names the smallest budget and host memory that would (exit 2).

Example:
    >>> from neutrain.config import load_recipe
    >>> fit = choose_fit(load_recipe("llama3_8b"), budget=11 * GIB, host=64 * GIB)
    >>> fit.label, fit.changes
    ("NeuZip weights, offloading 9 of 32 decoder layers' weights", {'memory.weights': 'neuzip-lossless', 'memory.offload_weights': True, 'memory.offload_layers': 9})
    >>> print(fit.line)  # doctest: +ELLIPSIS
    memory: weights neuzip-lossless (dense needs 16.78 GiB), offloading 9 of 32 decoder layers' weights: on the GPU it needs 12.04 GiB (phase 'train_step'), the budget is 11.00 GiB; predicted peak 10.34 GiB ...; predicted 1,686 tok/s (0.61 s a step on an H200)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from neutrain.config.schema import Recipe
from neutrain.errors import RecipeError
from neutrain.memory.budget import auto_budget
from neutrain.memory.configurations import (AUTO, Candidate, apply_changes, configurations, placement_label,
                                            tight_configurations)
from neutrain.memory.phase_planner import peak_phase, plan_recipe, predicted_gib
from neutrain.memory.placement import Placement
from neutrain.memory.planner import ACTIVATION_STAGING_BYTES, GIB, Estimate, estimate_recipe
from neutrain.memory.shape import ModelShape, recipe_shape
from neutrain.memory.step_time import COPY_HIDDEN_SHARE, CPU, GPU, StepTime, duration, rate, step_time
from neutrain.memory.tiers import HOST_PROCESS_BYTES, ActivationTiers, split

__all__ = ["FIT_HEADROOM", "Fit", "apply_changes", "candidates", "choose_fit", "link_cost", "pcie_bytes"]

FIT_HEADROOM = 0.05
"""Share of the budget a configuration must leave free: the budget is the allocator's hard limit, and the
planner's phases are within 6% of what the GPU measured for the 8B (tests/unit/memory/test_phase_planner.py),
so a prediction 1% under the budget is no promise."""


def pcie_bytes(train: Estimate) -> float:
    """Bytes a training step moves over PCIe: the weight store's both ways, the activations out and back.

    Example:
        >>> from neutrain.config import load_recipe
        >>> from neutrain.memory.planner import estimate_recipe
        >>> est = estimate_recipe(load_recipe("llama3_8b", ["memory.weights=neuzip-lossless", "memory.offload_weights=true",
        ...                                                 "memory.offload_layers=8"]))
        >>> round(pcie_bytes(est) / GIB, 2)  # 12 layers in (two stay in the slots at each turn), 8 out
        5.53
    """
    s = train.settings
    offloaded = s.get("host_activation_bytes", 0) + s.get("file_activation_bytes", 0)  # a file's go through the host
    return s.get("h2d_bytes_per_step", 0) + s.get("d2h_bytes_per_step", 0) + 2 * offloaded


def link_cost(train: Estimate) -> float:
    """Bytes over PCIe a training step waits for: those the copy streams do not hide (``COPY_HIDDEN_SHARE``).

    Example:
        >>> from neutrain.config import load_recipe
        >>> from neutrain.memory.planner import estimate_recipe
        >>> acts = estimate_recipe(load_recipe("llama3_8b", ["memory.weights=dense", "memory.offload_activations=true"]))
        >>> round(link_cost(acts) / GIB, 3)  # 32 layers x 1024 tokens x 4096 x 2 bytes, out and back in
        0.103
    """
    return (1 - COPY_HIDDEN_SHARE) * pcie_bytes(train)


@dataclass
class Fit:
    """A configuration tried (or chosen): the recipe keys it changes, its predicted phases and step."""

    label: str
    changes: dict[str, Any]
    plan: dict[str, Estimate]
    host_bytes: float
    budget: int | None = None
    line: str = ""
    tried: list[dict[str, Any]] = field(default_factory=list)
    step: StepTime | None = None
    weights: str | None = None
    placement: Placement | None = None  # the decision, once chosen (:func:`choose_fit`)
    tiers: ActivationTiers | None = None  # the offloaded layer inputs split for a short host (:mod:`.tiers`)
    unsplit_need: float = 0.0  # with tiers: the host bytes every layer input in host memory would need

    @property
    def peak(self) -> tuple[str, Estimate]:
        return peak_phase(self.plan)

    @property
    def link_bytes(self) -> float:
        """:func:`link_cost` of its training step."""
        return link_cost(self.plan["train_step"])

    @property
    def host_need(self) -> float:
        """Host bytes it needs: its pinned bytes and, where it pins any, the process's own
        (:data:`~neutrain.memory.tiers.HOST_PROCESS_BYTES`)."""
        return self.host_bytes + (HOST_PROCESS_BYTES if self.host_bytes else 0)

    def fits(self, budget: int | None, host: int | None) -> bool:
        """Its peak phase leaves :data:`FIT_HEADROOM` of ``budget``, and ``host`` holds :attr:`host_need`."""
        return ((budget is None or self.peak[1].reserved <= budget * (1 - FIT_HEADROOM))
                and (host is None or self.host_need <= host))

    def row(self, budget: int | None, host: int | None) -> dict[str, Any]:
        """Its entry in ``memory_fit.tried`` and in ``neutrain estimate``'s table."""
        return {"choice": self.label, "weights": self.weights, "peak_phase": self.peak[0],
                "predicted_reserved_gib": self.peak[1].reserved / GIB, "host_gib": self.host_bytes / GIB,
                "link_cost_gib": self.link_bytes / GIB,
                "predicted_tokens_per_s": self.step.tokens_per_s if self.step else None,
                "fits": self.fits(budget, host)}

    def as_dict(self) -> dict[str, Any]:
        """What ``summary.json`` records as ``memory_fit``."""
        name, worst = self.peak
        train = self.plan["train_step"]
        return {"choice": self.label, "changes": self.changes, "line": self.line, "weights": self.weights,
                "budget_gib": None if self.budget is None else self.budget / GIB,
                "peak_phase": name, "predicted_reserved_gib": worst.reserved / GIB,
                "predicted_device_gib": worst.device / GIB, "host_gib": self.host_bytes / GIB,
                "offloaded_layers": list(train.settings.get("offloaded", ())),
                "pcie_gib_per_step": pcie_bytes(train) / GIB, "link_cost_gib": self.link_bytes / GIB,
                "predicted_tokens_per_s": self.step.tokens_per_s if self.step else None,
                "predicted_step": self.step.as_dict() if self.step else None,
                "phases": predicted_gib(self.plan), "tried": self.tried,
                **({"activation_tiers": self.tiers.as_dict(), "file_gib": train.settings["file_activation_bytes"] / GIB}
                   if self.tiers else {})}


def _host_bytes(plan: dict[str, Estimate]) -> float:
    s = plan["train_step"].settings
    return s.get("host_pinned_bytes", 0) + s.get("host_activation_bytes", 0) + s.get("activation_staging_bytes", 0)


def candidates(recipe: Recipe, gpu: bool = True) -> list[tuple[str, dict[str, Any]]]:
    """Every configuration the fit may take, as (label, changes); explicit keys are left out of the changes.

    On CPU (``gpu=False``) nothing is offloaded (host and device memory are one).
    """
    return [(c.label, c.changes) for c in configurations(recipe, gpu=gpu)]


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _evaluate(candidate: Candidate, shape: ModelShape, budget: int | None, gpu: bool) -> Fit:
    plan = plan_recipe(candidate.recipe, candidate.train, shape)
    step = step_time(candidate.train, shape, GPU if gpu else CPU, candidate.recipe.train.gradient_accumulation_steps)
    return Fit(candidate.label, candidate.changes, plan, _host_bytes(plan), budget, step=step, weights=candidate.weights)


def _tiered(fit: Fit, candidate: Candidate, shape: ModelShape, budget: int, host: int) -> Fit:
    """``fit`` with its offloaded layer inputs split over the GPU, host memory and a file where the host
    cannot hold them all (:mod:`neutrain.memory.tiers`); as it is where it can, or where nothing is offloaded."""
    s = fit.plan["train_step"].settings
    if not s.get("offload_activations") or fit.host_need <= host:
        return fit
    device_room = budget * (1 - FIT_HEADROOM) - fit.plan["train_step"].reserved  # the split adds to the step alone
    host_room = host - HOST_PROCESS_BYTES - (fit.host_bytes - s["host_activation_bytes"])
    tiers = split(shape.layers, s["layer_input_bytes"], device_room, host_room)
    if tiers is None:
        return fit
    train = estimate_recipe(candidate.recipe, shape, tiers.device, tiers.file)
    plan = plan_recipe(candidate.recipe, train, shape)
    step = step_time(train, shape, GPU, candidate.recipe.train.gradient_accumulation_steps)
    return Fit(f"{candidate.label} ({tiers.clause(candidate.recipe.train.output_dir)})", candidate.changes, plan,
               _host_bytes(plan), budget, step=step, weights=candidate.weights, tiers=tiers, unsplit_need=fit.host_need)


TIE_SHARE = 0.01
"""Predicted steps closer than this share are a tie (the model is calibrated to 15%, not 1%): of tied
configurations the fit takes the one that changes the fewest keys, then the one that moves the fewest
bytes over PCIe (fewer layers streamed)."""


def _fastest(fits: list[Fit]) -> Fit:
    """The shortest predicted step (ties: :data:`TIE_SHARE`)."""
    best = min(f.step.step_s for f in fits)
    tied = [f for f in fits if f.step.step_s <= best * (1 + TIE_SHARE)]
    return min(tied, key=lambda f: (len(f.changes), pcie_bytes(f.plan["train_step"]), f.step.step_s))


def _tried(fits: list[Fit], families: list[tuple], budget: int | None, host: int | None) -> list[Fit]:
    """One configuration of each family (its streamed-layer counts aside): the fastest that fits, else the
    smallest; fastest first. This is ``neutrain estimate``'s table and ``memory_fit.tried``."""
    by_family: dict[tuple, list[Fit]] = {}
    for fit, family in zip(fits, families):
        by_family.setdefault(family, []).append(fit)
    shown = []
    for members in by_family.values():
        fitting = [f for f in members if f.fits(budget, host)]
        shown.append(_fastest(fitting) if fitting else min(members, key=lambda f: f.peak[1].reserved))
    return sorted(shown, key=lambda f: f.step.step_s)


def choose_fit(recipe: Recipe, budget: int | None, host: int | None, gpu: bool = True,
               card: int | None = None) -> Fit:
    """The fastest configuration whose every phase fits ``budget`` and whose host bytes fit ``host``.

    Args:
        recipe: The validated recipe (with :attr:`Recipe.explicit`).
        budget: Device budget in bytes (None: no budget; only ``memory.weights: auto`` is resolved, against
            ``card`` on a GPU or ``host`` on a CPU).
        host: Host memory available in bytes (None: unknown, not checked).
        gpu: Whether the run is on a GPU (offloading is only tried there; the step is predicted with
            :data:`~neutrain.memory.step_time.GPU`'s rates, else the CPU's).
        card: The card's total memory in bytes, for ``memory.weights: auto`` without a budget.

    Raises:
        RecipeError: nothing fits a budget; the message names the smallest budget and host memory that would.
    """
    shape = recipe_shape(recipe)
    auto = recipe.memory.weights == AUTO
    options = configurations(recipe, shape, gpu, levers=budget is not None)
    fits = [_evaluate(c, shape, budget, gpu) for c in options]
    tiered = gpu and budget is not None and host is not None
    if tiered:  # a short host: the layer inputs split over the tiers
        fits = [_tiered(f, c, shape, budget, host) for f, c in zip(fits, options)]
    limit = budget
    if budget is None:  # the weights alone, against the card's memory (a CPU: the host's)
        limit = (auto_budget(card) if card else None) if gpu else host
    ok = [f for f in fits if f.fits(limit, host)]
    loose = None  # the smallest configuration without the tight levers, where they were needed
    if budget is not None and not ok:  # the MLP in chunks, fewer weight slots: slower, tried only now
        loose = min(fits, key=lambda f: f.peak[1].reserved)
        tight = tight_configurations(recipe, shape, gpu)
        tight_fits = [_evaluate(c, shape, budget, gpu) for c in tight]
        if tiered:
            tight_fits = [_tiered(f, c, shape, budget, host) for f, c in zip(tight_fits, tight)]
        options += tight
        fits += tight_fits
        ok = [f for f in fits if f.fits(limit, host)]
    if budget is not None and not ok:
        _refuse_host(fits, budget, host)
        smallest = min(fits, key=lambda f: f.peak[1].reserved)
        name, worst = smallest.peak
        hosted = f" and {_gib(smallest.host_bytes)} of host memory" if smallest.host_bytes else ""
        have = f" with {_gib(host)} of host memory available" if host is not None else ""
        raise RecipeError(
            f"memory.device_budget_gib: nothing fits a budget of {_gib(budget)}{have}: the smallest configuration "
            f"({smallest.label}) needs a budget of {_gib(worst.reserved / (1 - FIT_HEADROOM))} (phase '{name}', "
            f"{_gib(worst.reserved)} predicted){hosted}; use a larger "
            "card or budget, a host with more memory, or a smaller data.sequence_len or train.micro_batch_size")
    chosen = _fastest(ok) if ok else min(fits, key=lambda f: f.peak[1].reserved)
    shown = _tried(fits, [c.family for c in options], limit, host)
    chosen.tried = [dict(f.row(limit, host), chosen=f is chosen) for f in shown]
    chosen.line = _line(recipe, chosen, fits, budget, limit, gpu, auto, bool(card), host, loose if ok else None)
    chosen.placement = _placement(chosen, budget)
    return chosen


def _refuse_host(fits: list[Fit], budget: int, host: int | None) -> None:
    """Where configurations fit the budget but none the host: one line naming the host memory available and the
    least any of them needs."""
    on_device = [f for f in fits if f.fits(budget, None)]
    if host is None or not on_device:
        return

    def least_need(f: Fit) -> float:  # every offloaded layer input in a file: the pinned weights and staging stay
        s = f.plan["train_step"].settings
        spilled = s.get("host_activation_bytes", 0)
        return f.host_need - spilled + (ACTIVATION_STAGING_BYTES if spilled and not s["activation_staging_bytes"] else 0)

    least = min(on_device, key=least_need)
    raise RecipeError(
        f"memory.device_budget_gib: nothing fits a budget of {_gib(budget)} with {_gib(host)} of host memory "
        f"available (NEUTRAIN_HOST_MEMORY_GIB, else MemAvailable): the configurations that fit the budget need at "
        f"least {_gib(least_need(least))} of host memory ({least.label}, its layer inputs in a file: "
        f"{_gib(least_need(least) - HOST_PROCESS_BYTES)} pinned and {_gib(HOST_PROCESS_BYTES)} for the process itself); "
        "use a host with more memory, a larger budget, or a smaller model")


def _placement(chosen: Fit, budget: int | None) -> Placement:
    """The chosen configuration as the decision the trainer acts on, from its own training-step estimate."""
    name, worst = chosen.peak
    s = chosen.plan["train_step"].settings
    return Placement(s["weights"], s["layers"], tuple(s.get("offloaded", ())),
                     offload_activations=bool(s["offload_activations"]), micro_batch_size=s["batch"], budget=budget,
                     activation_device_layers=s.get("activation_device_layers", 0),
                     activation_file_layers=s.get("activation_file_layers", 0),
                     activation_file_bytes=s.get("file_activation_bytes", 0),
                     peak_phase=name, peak_reserved=worst.reserved, phases=predicted_gib(chosen.plan),
                     host_bytes=chosen.host_bytes, lines=(chosen.line,))


def _unconstrained(fits: list[Fit], weights: str, recipe: Recipe) -> Fit | None:
    """The configuration of ``weights`` that offloads nothing at the recipe's micro-batch."""
    for f in fits:
        chosen = apply_changes(recipe, f.changes)
        m, t = chosen.memory, chosen.train
        if (f.weights == weights and not m.offload_activations and not m.offload_weights
                and t.micro_batch_size == recipe.train.micro_batch_size):
            return f
    return None


def _weights_clause(recipe: Recipe, chosen: Fit, fits: list[Fit], limit: int | None, room: str) -> str:
    """``weights dense (...)`` / ``weights neuzip-lossless (...)``: what ``auto`` resolved to, and why."""
    dense = _unconstrained(fits, "dense", recipe)
    if chosen.weights == "dense":
        if dense is None or len({f.weights for f in fits}) == 1:
            return "weights dense (NeuZip needs a fused optimizer)"
        need = dense.peak[1].reserved
        return (f"weights dense (needs {_gib(need)} of {room}; NeuZip would be used below "
                f"{_gib(need / (1 - FIT_HEADROOM))})")
    if dense is not None and not dense.fits(limit, None):
        of = "" if room.endswith("budget") else f" of {room}"  # a budget is named after the clause
        return f"weights {chosen.weights} (dense needs {_gib(dense.peak[1].reserved)}{of})"
    return f"weights {chosen.weights} (predicted faster here than dense)"


def _line(recipe: Recipe, chosen: Fit, fits: list[Fit], budget: int | None, limit: int | None, gpu: bool,
          auto: bool, card: bool, host: int | None = None, loose: Fit | None = None) -> str:
    """The run's one memory line: what was chosen, why, its predicted peak and its predicted speed."""
    step = chosen.step
    speed = f"predicted {rate(step.tokens_per_s)} tok/s ({duration(step.step_s)} a step on {'an H200' if gpu else 'this CPU'})"
    name, worst = chosen.peak
    if budget is None:
        setting = recipe.memory.device_budget_gib  # none, or auto with no card to resolve it against
        if not auto:
            return (f"memory: no device budget (memory.device_budget_gib: {setting}"
                    + (", and no GPU" if setting == "auto" else "") + f"), the recipe's configuration as it is; {speed}")
        room = (f"the card's {_gib(limit)}" if card else "no card to check") if gpu else f"the host's {_gib(limit or 0)}"
        return (f"memory: {_weights_clause(recipe, chosen, fits, limit, room)}; no device budget, the recipe's other "
                f"keys as they are; {speed}")
    head = f"memory: {_weights_clause(recipe, chosen, fits, limit, f'the {_gib(budget)} budget')}, " if auto else "memory: "
    m = apply_changes(recipe, chosen.changes).memory
    where = "on the GPU" if gpu else "(CPU: recorded, not enforced)"
    batch_changed = "train.micro_batch_size" in chosen.changes
    if not (m.offload_activations or m.offload_weights or batch_changed or "memory.mlp_chunk_tokens" in chosen.changes):
        return (f"{head}fits the {_gib(budget)} budget {where} (predicted peak {_gib(worst.reserved)} "
                f"reserved in phase '{name}', {_gib(worst.device)} device); {speed}")
    first = _unconstrained(fits, chosen.weights, recipe)
    first_name, first_peak = first.peak if first is not None else (name, worst)
    as_is = "on the GPU it" if gpu else "at its micro-batch size it"  # a CPU offloads nothing
    why = (f"the host's {_gib(host)} cannot hold every layer input ({_gib(chosen.unsplit_need)} with the process's "
           f"{_gib(HOST_PROCESS_BYTES)})" if chosen.tiers and host is not None
           else (f"the smallest configuration with the MLP whole and the usual weight slots needs a budget of "
                 f"{_gib(loose.peak[1].reserved / (1 - FIT_HEADROOM))} (phase '{loose.peak[0]}')") if loose is not None
           else f"{as_is} needs {_gib(first_peak.reserved)} (phase '{first_name}')"
           if first is None or not first.fits(budget, None)
           else f"{as_is} needs {_gib(first.host_bytes)} of host memory" if first.host_bytes
           else f"{as_is} is predicted slower ({rate(first.step.tokens_per_s)} tok/s)")
    label = chosen.label.split(", ", 1)[1] if auto else chosen.label  # the head names the weights
    pcie = pcie_bytes(chosen.plan["train_step"])
    return (f"{head if auto else 'memory: '}{label}: {why}, the budget is {_gib(budget)}; predicted peak "
            f"{_gib(worst.reserved)} reserved in phase '{name}'"
            + (f", {_gib(chosen.host_bytes)} of host memory" if chosen.host_bytes else "")
            + (f", {_gib(pcie)} over PCIe a step" if pcie else "") + f"; {speed}")
