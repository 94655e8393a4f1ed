"""Where a run's memory goes, decided before anything is built, and held to while it runs.

The package's modules, from the bottom: :mod:`~neutrain.memory.model_config` (the model's config, read
without building it), :mod:`~neutrain.memory.shape` (every parameter the build makes, experts included),
:mod:`~neutrain.memory.planner` (one training step's peak as named terms),
:mod:`~neutrain.memory.phase_planner` (every phase of a run), :mod:`~neutrain.memory.step_time` (one
step's time), :mod:`~neutrain.memory.configurations`, :mod:`~neutrain.memory.tiers` (the offloaded layer
inputs split over the GPU, host memory and a file for a short host) and :mod:`~neutrain.memory.fit` (the
fastest configuration that fits the budget and the host), :mod:`~neutrain.memory.residency` (what ``neutrain generate`` keeps on
the GPU), :mod:`~neutrain.memory.placement` (the decision both end in), :mod:`~neutrain.memory.budget` (the
budget and the allocator's limit) and :mod:`~neutrain.memory.phases` (each phase's measured peak).

Code outside the package imports the names below from ``neutrain.memory`` itself, never one of its
modules (``tests/unit/memory/test_boundary.py``): the modules may then be split, merged or renamed freely.
Each name is imported on first use, so ``neutrain estimate`` pays for the planner alone (no torch,
no transformers) and ``import neutrain.memory`` costs nothing.

Example:
    >>> from neutrain.config import load_recipe
    >>> from neutrain.memory import GIB, choose_fit
    >>> fit = choose_fit(load_recipe("llama3_8b"), budget=22 * GIB, host=64 * GIB)
    >>> fit.placement.weights, fit.placement.streamed
    ('dense', ())
"""

from __future__ import annotations

import importlib

#: Each public name and the module of this package that defines it.
PUBLIC = {
    "config_only": "model_config", "gguf_call": "model_config", "gguf_errors": "model_config",
    "gguf_source": "model_config", "recipe_config": "model_config", "shape_config": "model_config",
    "ModelShape": "shape", "recipe_shape": "shape",
    "CUDA_CONTEXT_BYTES": "planner", "Estimate": "planner", "GIB": "planner", "NEUZIP_BITS": "planner",
    "estimate": "planner", "estimate_recipe": "planner", "offload_traffic": "planner",
    "generation_plan": "phase_planner", "peak_phase": "phase_planner", "plan_recipe": "phase_planner",
    "plan_table": "phase_planner", "predicted_gib": "phase_planner",
    "duration": "step_time", "rate": "step_time", "recipe_step_time": "step_time",
    "apply_changes": "configurations", "weight_options": "configurations",
    "FIT_HEADROOM": "fit", "Fit": "fit", "choose_fit": "fit", "link_cost": "fit", "pcie_bytes": "fit",
    "Residency": "residency", "decide": "residency",
    "Placement": "placement",
    "auto_budget": "budget", "enforce_budget": "budget", "resolve_budget": "budget",
    "PHASES": "phases", "TRACKER": "phases", "current_phase": "phases", "device_memory_used": "phases",
    "out_of_memory_line": "phases", "phase": "phases",
}

__all__ = sorted(PUBLIC)


def __getattr__(name: str):
    module = PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'neutrain.memory' has no attribute {name!r}")
    # Not cached here: the defining module stays the one place a name is bound (a test that replaces
    # ``phases.TRACKER`` replaces it for every caller).
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(PUBLIC))
