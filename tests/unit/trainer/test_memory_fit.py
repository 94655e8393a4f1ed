"""The automatic fit: a card of each size gets the cheapest configuration that fits it.

The 8B recipe (NeuZip lossless, LOMO, checkpointing) on fake cards of 24, 16, 12 and 8 GB and on the
budgets the lead's GPU script uses (22, 14.5, 11 and 7 GiB, and 5 for a 6 GB card); a key the user set
is never changed; nothing fitting is one RecipeError naming the smallest budget and host memory that
would. Planner only: no model is built.
"""

from __future__ import annotations

import dataclasses

import pytest

from neutrain.config import RecipeError, load_recipe
from neutrain.trainer.fit import (
    AUTO_MARGIN_BYTES, FIT_HEADROOM, Fit, apply_changes, auto_budget, candidates, choose_fit, link_cost, resolve_budget,
)
from neutrain.trainer.phase_planner import plan_recipe
from neutrain.trainer.planner import CUDA_CONTEXT_BYTES, GIB

GPU, ACT, BOTH, WEIGHTS = "on the GPU", "offloading activations", "offloading weights and activations", "offloading weights"
LAYERS = "of 32 decoder layers' weights"  # a part of the layers in host memory
HOST = 64 * GIB


def _8b(*overrides: str):
    return load_recipe("recipes/llama3_8b.yaml", list(overrides))


def _kind(label: str) -> str:
    if LAYERS in label:
        return "layers+act" if label.startswith("offloading activations and") else "layers"
    return label


def _assert_cheapest_that_fits(recipe, fit, budget):
    """No configuration the fit could take is cheaper on the link and fits; the ones tried before did not fit."""
    name, worst = fit.peak
    assert all(e.reserved <= budget * (1 - FIT_HEADROOM) for e in fit.plan.values())  # every phase, not only the peak
    assert [t["fits"] for t in fit.as_dict()["tried"]] == [False] * (len(fit.tried) - 1) + [True]
    for label, changes in candidates(recipe):
        plan = plan_recipe(apply_changes(recipe, changes))
        other = Fit(label, changes, plan, 0)
        if other.fits(budget, HOST):
            assert link_cost(plan["train_step"]) >= fit.link_bytes, (label, fit.label)


@pytest.mark.parametrize("card_gb, batch, expected", [
    (24, 1, GPU), (16, 1, GPU), (12, 1, "layers"), (8, 1, "layers"),
    (24, 8, GPU), (16, 8, "layers"), (12, 8, "layers"), (8, 8, "layers+act"),
])
def test_a_fake_card_of_each_size_picks_the_cheapest_configuration_that_fits(card_gb, batch, expected):
    budget = resolve_budget("auto", card_gb * 10**9)  # as torch reports a card: bytes
    assert budget == card_gb * 10**9 - CUDA_CONTEXT_BYTES - AUTO_MARGIN_BYTES
    recipe = _8b(f"train.micro_batch_size={batch}")
    fit = choose_fit(recipe, budget, HOST)
    assert _kind(fit.label) == expected, fit.line
    _assert_cheapest_that_fits(recipe, fit, budget)
    assert fit.line.startswith(f"memory: {'fits' if expected == GPU else fit.label}")


def test_a_12gb_card_keeps_most_layers_on_the_gpu():
    # 11 GiB, batch 1: the 8B needs 12.2 GiB on the GPU. Streaming every layer (what the fit did before it
    # had levers between) ran at 0.67-0.76x of the unbounded speed; a few layers in host memory fit.
    recipe = _8b("memory.device_budget_gib=11")
    fit = choose_fit(recipe, resolve_budget(recipe.memory.device_budget_gib, 80 * GIB), HOST)
    chosen = apply_changes(recipe, fit.changes)
    assert chosen.memory.offload_weights and not chosen.memory.offload_activations
    assert 3 <= chosen.memory.offload_layers <= 16, fit.line  # a part of the 32 layers, spread between the others
    assert fit.label == f"offloading {chosen.memory.offload_layers} of 32 decoder layers' weights"
    assert fit.line.startswith(f"memory: {fit.label}: on the GPU it needs 12.")
    record = fit.as_dict()
    assert record["offloaded_layers"] == list(fit.plan["train_step"].settings["offloaded"])
    assert len(record["offloaded_layers"]) == chosen.memory.offload_layers
    every_layer = plan_recipe(apply_changes(recipe, {"memory.offload_weights": True}))
    assert fit.link_bytes < link_cost(every_layer["train_step"]) / 3  # a third of the bytes, or fewer
    _assert_cheapest_that_fits(recipe, fit, 11 * GIB)


def test_a_6gb_card_runs_every_phase_at_5_gib():
    fit = choose_fit(_8b("memory.device_budget_gib=5"), 5 * GIB, HOST)
    assert fit.changes.get("memory.offload_weights") is True
    assert all(e.reserved <= 5 * GIB * (1 - FIT_HEADROOM) for e in fit.plan.values())


@pytest.mark.parametrize("budget_gib, batch, expected", [
    (22, 1, GPU), (14.5, 1, GPU), (11, 1, "layers"), (7, 1, "layers"), (5, 1, WEIGHTS),
    (22, 8, GPU), (14.5, 8, "layers"), (11, 8, "layers"), (7, 8, "layers+act"),
])
def test_the_lead_script_budgets_pick_the_expected_configuration(budget_gib, batch, expected):
    recipe = _8b(f"train.micro_batch_size={batch}", f"memory.device_budget_gib={budget_gib}")
    budget = resolve_budget(recipe.memory.device_budget_gib, 80 * GIB)
    assert budget == int(budget_gib * GIB)
    fit = choose_fit(recipe, budget, HOST)
    assert _kind(fit.label) == expected, fit.line
    chosen = apply_changes(recipe, fit.changes)
    assert chosen.memory.offload_weights == (expected != GPU)
    assert chosen.memory.offload_activations == (expected == "layers+act")
    assert (chosen.memory.offload_layers is None) == (expected in (GPU, WEIGHTS))
    assert chosen.train.micro_batch_size == batch  # set on the command line: explicit, kept


def _needs(plan) -> str:
    """The budget a configuration needs, as the error names it (its peak phase with the fit's headroom)."""
    name = max(plan, key=lambda k: plan[k].reserved)
    return f"needs a budget of {plan[name].reserved / (1 - FIT_HEADROOM) / GIB:.2f} GiB (phase '{name}'"


def test_an_explicit_key_is_never_overridden():
    # offload_activations set false on the command line: at batch 8 under 14.5 GiB the fit may not turn it
    # on, so it goes on to the weights (without activation offload).
    recipe = _8b("train.micro_batch_size=8", "memory.offload_activations=false")
    assert "memory.offload_activations" in recipe.explicit
    fit = choose_fit(recipe, int(14.5 * GIB), HOST)
    assert fit.changes["memory.offload_weights"] is True and "memory.offload_activations" not in fit.changes
    assert apply_changes(recipe, fit.changes).memory.offload_activations is False
    # offload_weights and offload_layers set: the layers stay as given, only activation offload may change.
    given = _8b("memory.offload_weights=true", "memory.offload_layers=20")
    assert {c.get("memory.offload_layers", 20) for _, c in candidates(given)} == {20}
    assert [label for label, _ in candidates(given)] == ["offloading 20 of 32 decoder layers' weights",
                                                         "offloading activations and 20 of 32 decoder layers' weights"]
    # Both offload keys pinned: nothing fits 7 GiB, and the error says what would.
    pinned = _8b("memory.offload_activations=false", "memory.offload_weights=false")
    with pytest.raises(RecipeError) as err:
        choose_fit(pinned, 7 * GIB, HOST)
    assert "nothing fits a budget of 7.00 GiB" in str(err.value)
    assert f"(on the GPU) {_needs(plan_recipe(pinned))}" in str(err.value)


def test_a_key_set_in_the_recipe_file_counts_as_explicit(tmp_path):
    text = open("recipes/llama3_8b.yaml", encoding="utf-8").read().replace(
        "  gradient_checkpointing: true\n", "  gradient_checkpointing: true\n  offload_weights: false\n")
    path = tmp_path / "r.yaml"
    path.write_text(text, encoding="utf-8")
    recipe = load_recipe(path)
    assert "memory.offload_weights" in recipe.explicit and "memory.offload_activations" not in recipe.explicit
    assert all("memory.offload_weights" not in changes for _, changes in candidates(recipe))
    # Activation offload alone cannot bring the 8B under 11 GiB (the weights stay on the GPU).
    with pytest.raises(RecipeError) as err:
        choose_fit(recipe, 11 * GIB, HOST)
    acts = plan_recipe(apply_changes(recipe, {"memory.offload_activations": True}))
    assert "nothing fits a budget of 11.00 GiB" in str(err.value)
    assert f"(offloading activations) {_needs(acts)}" in str(err.value)


def test_nothing_fits_names_the_smallest_budget_and_host_memory():
    with pytest.raises(RecipeError) as err:
        choose_fit(_8b(), 3 * GIB, HOST)
    message = str(err.value)
    assert "\n" not in message and message.startswith("memory.device_budget_gib: nothing fits a budget of 3.00 GiB")
    # The smallest: every layer's weights and the activations in host memory, named with its figures.
    smallest = plan_recipe(_8b("memory.offload_weights=true", "memory.offload_activations=true"))
    assert f"the smallest configuration ({BOTH}) {_needs(smallest)}" in message
    host = smallest["train_step"].settings
    assert f"and {(host['host_pinned_bytes'] + host['host_activation_bytes']) / GIB:.2f} GiB of host memory" in message
    # The host must hold the offloaded weights: with too little, weight offload does not fit either.
    with pytest.raises(RecipeError, match="with 4.00 GiB of host memory available"):
        choose_fit(_8b(), 7 * GIB, 4 * GIB)


def test_a_smaller_micro_batch_keeps_the_rows_per_step():
    # Dense weights cannot be offloaded (NeuZip only): after activation offload comes the micro-batch.
    recipe = _8b("memory.weights=dense", "train.micro_batch_size=8")
    assert not any("micro_batch_size" in label for label, _ in candidates(recipe))  # the user set it: kept
    # As if the recipe left both batch keys to their defaults (a default of 8 rows):
    recipe = dataclasses.replace(
        recipe, explicit=recipe.explicit - {"train.micro_batch_size", "train.gradient_accumulation_steps"})
    labels = [label for label, _ in candidates(recipe)]
    assert labels[:2] == [GPU, ACT] and not any("weights" in label for label in labels)
    on_gpu = choose_fit(recipe, 80 * GIB, HOST)
    assert on_gpu.label == GPU
    acts = plan_recipe(apply_changes(recipe, {"memory.offload_activations": True}))
    budget = int(max(e.reserved for e in acts.values()) / (1 - FIT_HEADROOM)) - 1  # just too small for 8 rows at once
    fit = choose_fit(recipe, budget, HOST)
    chosen = apply_changes(recipe, fit.changes)
    assert chosen.train.micro_batch_size < 8
    assert chosen.train.micro_batch_size * chosen.train.gradient_accumulation_steps == 8
    assert fit.label.startswith(f"micro_batch_size {chosen.train.micro_batch_size} x ")


def test_no_budget_keeps_the_recipe_and_auto_needs_a_card():
    assert resolve_budget("none", 80 * GIB) is None and resolve_budget("auto", None) is None
    assert resolve_budget("auto", 80 * GIB) == auto_budget(80 * GIB)
    fit = choose_fit(_8b(), None, HOST)
    assert fit.changes == {} and "no device budget" in fit.line
    # On a CPU nothing is offloaded: only the micro-batch may change.
    assert [label for label, _ in candidates(_8b(), gpu=False)] == [GPU]


@pytest.mark.parametrize("text, expected", [("auto", "auto"), ("AUTO", "auto"), ("none", "none"), ("off", "none"),
                                            ("null", "none"), ("14.5", 14.5), ("7", 7.0), ("1e1", 10.0)])
def test_the_budget_setting_reads_auto_none_or_gib(text, expected):
    assert _8b(f"memory.device_budget_gib={text}").memory.device_budget_gib == expected


@pytest.mark.parametrize("text, says", [("0", "must be greater than 0"), ("-2", "must be greater than 0"),
                                        ("lots", "expected auto, none, off or a number of GiB > 0, got 'lots'"),
                                        ("true", "got True"), (".nan", "not a finite number"), ("nan", "got 'nan'")])
def test_a_bad_budget_setting_names_the_key(text, says):
    with pytest.raises(RecipeError) as err:
        _8b(f"memory.device_budget_gib={text}")
    assert str(err.value).startswith("memory.device_budget_gib: ") and says in str(err.value)
