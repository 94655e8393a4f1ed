"""The run's device budget: the automatic fit before the build, the allocator's limit, the phase report after.

``neutrain train`` calls :func:`fit_memory` once the process state exists and before anything is built:
it resolves ``memory.device_budget_gib`` against this card, picks the configuration
(:mod:`neutrain.memory.fit`), prints the one line saying which and why, and on CUDA sets the
allocator's hard limit to the budget. After the run, :func:`phase_report` puts each phase's measured
peaks (:mod:`neutrain.memory.phases`) beside the planner's prediction in ``metrics.jsonl`` and the
summary.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

from neutrain.cli.preflight import host_memory_for
from neutrain.config.schema import Recipe
from neutrain.errors import RecipeError

logger = logging.getLogger("neutrain")


SLOW_STEP_S = 120.0
"""A step predicted longer than this (:mod:`neutrain.memory.step_time`) is refused before the build unless
``train.allow_slow_device``: the 8B recipe on a 2-core CPU printed one line and then nothing for more than 11
minutes while it built, and would have taken minutes a step after that. The CPU recipes predict under 10 s."""


def _weights_without_fit(recipe: Recipe, why: str, echo: Callable[[str], None] | None) -> Recipe:
    """``memory.weights: auto`` where no fit can be made: NeuZip lossless where the recipe can train it (the
    same model in less memory), else dense; said in one line."""
    from neutrain.memory import apply_changes, weight_options  # lazy: `neutrain --help` stays instant

    weights = weight_options(recipe)[-1]
    if echo is not None:
        echo(f"memory: weights {weights} (memory.weights: auto, and {why})")
    return apply_changes(recipe, {"memory.weights": weights})


def settle_weights(recipe: Recipe, echo: Callable[[str], None] | None = None, processes: int = 1) -> Recipe:
    """The recipe with ``memory.weights: auto`` resolved against this machine (no budget: the card's memory, on
    a CPU the host's), for a trainer built without :func:`fit_memory` (``build_trainer`` from Python)."""
    if recipe.memory.weights != "auto":
        return recipe
    import torch  # lazy: `neutrain --help` stays instant

    from neutrain.memory import apply_changes, choose_fit  # lazy: `neutrain --help` stays instant

    gpu = not recipe.train.use_cpu and torch.cuda.is_available()
    card = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if gpu else None
    try:
        fit = choose_fit(recipe, None, host_memory_for(processes), gpu=gpu, card=card)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return _weights_without_fit(recipe, f"no fit: {' '.join(str(exc).split())}", echo)
    if echo is not None:
        echo(fit.line)
    return apply_changes(recipe, fit.changes)


def check_step_time(recipe: Recipe, fit, gpu: bool) -> None:
    """Refuse, before the build, a run whose step is predicted longer than :data:`SLOW_STEP_S` on a CPU.

    Raises:
        RecipeError: one line with the predicted time per step here and on the GPU the rates are measured on,
            and what to run instead (``train.allow_slow_device=true`` runs it anyway).
    """
    if gpu or fit is None or fit.step is None or recipe.train.allow_slow_device or fit.step.step_s <= SLOW_STEP_S:
        return
    from neutrain.memory import choose_fit, duration, rate  # lazy: `neutrain --help` stays instant

    on_gpu = choose_fit(recipe, None, None, gpu=True)
    name = recipe.source or "this recipe"
    raise RecipeError(
        f"train.allow_slow_device: {name} is a GPU recipe: a step is predicted to take {duration(fit.step.step_s)} on "
        f"this CPU ({rate(fit.step.tokens_per_s)} tok/s), {duration(on_gpu.step.step_s)} on an H200 with "
        f"{on_gpu.peak[1].reserved / 2**30:.1f} GiB of GPU memory; on a CPU use recipes/default.yaml, or set "
        "train.allow_slow_device=true to train here anyway")


def fit_memory(recipe: Recipe, state, echo: Callable[[str], None] = print):
    """Resolve the budget, choose the configuration, enforce the budget; returns ``(recipe, fit or None)``.

    ``fit`` is None where the planner cannot read the model config without building it (the build then
    names what is wrong) and for sharded runs (FSDP, DeepSpeed: each process holds part of the model);
    the budget is enforced all the same, and ``memory.weights: auto`` is resolved without a fit
    (NeuZip lossless where the recipe can train it; sharded runs: dense).

    Raises:
        RecipeError: nothing fits (one line naming the smallest budget and host memory that would; exit 2), or
            a CPU step is predicted longer than :data:`SLOW_STEP_S` (:func:`check_step_time`).
    """
    import torch  # lazy: `neutrain --help` stays instant

    # lazy: `neutrain --help` stays instant
    from neutrain.memory import TRACKER, apply_changes, choose_fit, enforce_budget, predicted_gib, resolve_budget

    TRACKER.reset()
    gpu = not recipe.train.use_cpu and torch.cuda.is_available()
    device = None
    if gpu and state.device.type == "cuda":
        # An index: set_per_process_memory_fraction refuses a torch.device("cuda") without one.
        device = state.device.index if state.device.index is not None else torch.cuda.current_device()
    card = torch.cuda.get_device_properties(device).total_memory if device is not None else None
    budget = resolve_budget(recipe.memory.device_budget_gib, card)
    TRACKER.budget_gib = None if budget is None else budget / 2**30
    t = recipe.train
    try:
        if t.fsdp or t.deepspeed or t.distributed in ("fsdp2", "deepspeed"):
            # The planner models one whole model per process; a sharded run holds a part of it. Choosing
            # from whole-model figures would offload (or refuse) what fits: the budget is only enforced.
            raise ValueError("a sharded run (FSDP or DeepSpeed) holds part of the model, which the planner does not model")
        fit = choose_fit(recipe, budget, host_memory_for(getattr(state, "num_processes", 1)), gpu=device is not None, card=card)
    except RecipeError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        why = " ".join(str(exc).split())
        logger.warning("memory: no automatic fit (%s); the recipe's configuration is kept", why)
        fit = None
        if recipe.memory.weights == "auto":
            recipe = _weights_without_fit(recipe, f"no automatic fit: {why}", echo if state.is_main_process else None)
    if fit is not None:
        check_step_time(recipe, fit, device is not None)  # the recipe as asked: its GPU figures choose their own weights
        recipe = apply_changes(recipe, fit.changes)
        TRACKER.predicted = predicted_gib(fit.plan)
        if state.is_main_process:
            echo(fit.line)
    if device is not None and budget is not None:
        enforce_budget(budget, device)
    return recipe, fit


def phase_report(summary: dict[str, Any], fit, out: str, step: int) -> None:
    """Add ``phase_memory`` (and ``memory_fit``) to ``summary`` and one record per phase to ``metrics.jsonl``.

    On CUDA the summary's ``peak_memory_gib``/``peak_reserved_gib`` become the highest phase's: the run's peak.

    Each record: ``{"step", "phase", "runs", "peak_allocated_gib", "peak_reserved_gib", "device_used_gib",
    "predicted_allocated_gib", "predicted_reserved_gib", "predicted_device_gib", "reserved_relative_error"}``
    (measured figures only on CUDA, predicted ones where the planner could read the model config, the
    error predicted / measured - 1 where both are there).
    """
    from neutrain.memory import PHASES, TRACKER  # lazy: `neutrain --help` stays instant

    if fit is not None:
        summary["memory_fit"] = fit.as_dict()
    phases: dict[str, dict[str, Any]] = {}
    for name in PHASES:
        rec = TRACKER.records.get(name)
        if rec is None:
            continue
        entry = rec.as_dict()
        entry.update({f"predicted_{k}": v for k, v in TRACKER.predicted.get(name, {}).items()})
        if entry.get("peak_reserved_gib") and "predicted_reserved_gib" in entry:
            # The planner's accuracy over a run (its worst phase) is the largest of these.
            entry["reserved_relative_error"] = entry["predicted_reserved_gib"] / entry["peak_reserved_gib"] - 1
        phases[name] = entry
    summary["phase_memory"] = phases
    measured = [TRACKER.records[name] for name in phases if TRACKER.records[name].measured]
    if measured:
        # Each phase resets the allocator's peak statistics, so the run's peak is the highest phase's.
        summary["peak_memory_gib"] = max(r.peak_allocated for r in measured) / 2**30
        summary["peak_reserved_gib"] = max(r.peak_reserved for r in measured) / 2**30
    if not phases:
        return
    from neutrain.trainer.callbacks import append_metrics  # lazy: `neutrain --help` stays instant

    append_metrics(out, [{"step": step, **entry} for entry in phases.values()])


def phase_lines(summary: dict[str, Any]) -> list[str]:
    """The summary's short table: each phase's measured peaks beside the planner's prediction (GiB); none when no
    phase was measured (a CPU run).

    Example:
        >>> for line in phase_lines({"phase_memory": {"save": {"phase": "save", "runs": 1, "peak_allocated_gib": 12.0,
        ...         "peak_reserved_gib": 12.1, "device_used_gib": 12.9, "predicted_reserved_gib": 12.13}}}):
        ...     print(line)
        memory by phase  allocated  reserved  device  predicted reserved (GiB)
          save               12.00     12.10   12.90  12.13
    """
    def cell(value: float | None, width: int) -> str:
        return f"{'-':>{width}}" if value is None else f"{value:>{width}.2f}"

    phases = summary.get("phase_memory") or {}
    if not any(e.get("peak_reserved_gib") is not None for e in phases.values()):
        # Nothing measured (a CPU run has no device allocator): a table of dashes beside GPU predictions says
        # nothing about this run, whose memory is the summary's process RSS.
        return []
    rows = []
    for name, e in phases.items():
        if e.get("peak_reserved_gib") is None and e.get("predicted_reserved_gib") is None:
            continue
        rows.append(f"  {name:<14}{cell(e.get('peak_allocated_gib'), 10)}{cell(e.get('peak_reserved_gib'), 10)}"
                    f"{cell(e.get('device_used_gib'), 8)}  {cell(e.get('predicted_reserved_gib'), 0).strip()}")
    if not rows:
        return []
    return ["memory by phase  allocated  reserved  device  predicted reserved (GiB)", *rows]
