"""The automatic fit: a card of each size gets the fastest configuration that fits it.

The 8B recipe (NeuZip lossless, LOMO, checkpointing) on fake cards of 24, 16, 12 and 8 GB and on the
budgets the lead's H100 script uses (22, 14.5, 11 and 7 GiB); a key the user set is never changed;
nothing fitting is one RecipeError naming the smallest budget and host memory that would.
"""

from __future__ import annotations

import dataclasses

import pytest

from neutrain.config import RecipeError, load_recipe
from neutrain.trainer.fit import AUTO_MARGIN_BYTES, apply_changes, auto_budget, candidates, choose_fit, resolve_budget
from neutrain.trainer.planner import CUDA_CONTEXT_BYTES, GIB

GPU, ACT, BOTH = "on the GPU", "offloading activations", "offloading weights and activations"
HOST = 64 * GIB


def _8b(*overrides: str):
    return load_recipe("recipes/llama3_8b.yaml", list(overrides))


@pytest.mark.parametrize("card_gb, batch, expected", [
    (24, 1, GPU), (16, 1, GPU), (12, 1, BOTH), (8, 1, BOTH),
    (24, 8, GPU), (16, 8, ACT), (12, 8, BOTH), (8, 8, BOTH),
])
def test_a_fake_card_of_each_size_picks_the_expected_configuration(card_gb, batch, expected):
    budget = resolve_budget("auto", card_gb * 10**9)  # as torch reports a card: bytes
    assert budget == card_gb * 10**9 - CUDA_CONTEXT_BYTES - AUTO_MARGIN_BYTES
    fit = choose_fit(_8b(f"train.micro_batch_size={batch}"), budget, HOST)
    assert fit.label == expected, fit.line
    name, worst = fit.peak
    assert worst.reserved <= budget
    assert all(e.reserved <= budget for e in fit.plan.values())  # every phase, not only the peak one
    assert fit.line.startswith(f"memory: {'fits' if expected == GPU else expected}")
    # The faster configurations before it were tried and did not fit.
    assert [t["fits"] for t in fit.as_dict()["tried"]] == [False] * (len(fit.tried) - 1) + [True]


@pytest.mark.parametrize("budget_gib, batch, expected", [
    (22, 1, GPU), (14.5, 1, GPU), (11, 1, BOTH), (7, 1, BOTH),
    (22, 8, GPU), (14.5, 8, ACT), (11, 8, BOTH), (7, 8, BOTH),
])
def test_the_lead_script_budgets_pick_the_expected_configuration(budget_gib, batch, expected):
    recipe = _8b(f"train.micro_batch_size={batch}", f"memory.device_budget_gib={budget_gib}")
    budget = resolve_budget(recipe.memory.device_budget_gib, 80 * GIB)
    assert budget == int(budget_gib * GIB)
    fit = choose_fit(recipe, budget, HOST)
    assert fit.label == expected, fit.line
    chosen = apply_changes(recipe, fit.changes)
    assert chosen.memory.offload_weights == (expected == BOTH)
    assert chosen.memory.offload_activations == (expected != GPU)
    assert chosen.train.micro_batch_size == batch  # set on the command line: explicit, kept


def test_an_explicit_key_is_never_overridden():
    # offload_activations set false on the command line: at batch 8 under 14.5 GiB the fit may not turn it
    # on, so it goes on to the weights (without activation offload).
    recipe = _8b("train.micro_batch_size=8", "memory.offload_activations=false")
    assert "memory.offload_activations" in recipe.explicit
    fit = choose_fit(recipe, int(14.5 * GIB), HOST)
    assert fit.changes == {"memory.offload_weights": True}
    assert apply_changes(recipe, fit.changes).memory.offload_activations is False
    # Both offload keys pinned: nothing fits 7 GiB, and the error says what would.
    pinned = _8b("memory.offload_activations=false", "memory.offload_weights=false")
    with pytest.raises(RecipeError) as err:
        choose_fit(pinned, 7 * GIB, HOST)
    assert "nothing fits a budget of 7.00 GiB" in str(err.value) and "(on the GPU) needs a budget of 13.21 GiB" in str(err.value)


def test_a_key_set_in_the_recipe_file_counts_as_explicit(tmp_path):
    text = open("recipes/llama3_8b.yaml", encoding="utf-8").read().replace(
        "  gradient_checkpointing: true\n", "  gradient_checkpointing: true\n  offload_weights: false\n")
    path = tmp_path / "r.yaml"
    path.write_text(text, encoding="utf-8")
    recipe = load_recipe(path)
    assert "memory.offload_weights" in recipe.explicit and "memory.offload_activations" not in recipe.explicit
    assert all("memory.offload_weights" not in changes for _, changes in candidates(recipe))
    # Activation offload alone cannot bring the build's 13.21 GiB under 11 (the weights stay on the GPU).
    with pytest.raises(RecipeError, match="nothing fits a budget of 11.00 GiB .* needs a budget of 13.21 GiB \\(phase 'build'\\)"):
        choose_fit(recipe, 11 * GIB, HOST)


def test_nothing_fits_names_the_smallest_budget_and_host_memory():
    with pytest.raises(RecipeError) as err:
        choose_fit(_8b(), 3 * GIB, HOST)
    message = str(err.value)
    assert "\n" not in message and message.startswith("memory.device_budget_gib: nothing fits a budget of 3.00 GiB")
    smallest = choose_fit(_8b(), 7 * GIB, HOST)  # what would fit: the same figures as the message names
    assert f"needs a budget of {smallest.peak[1].reserved / GIB:.2f} GiB" in message
    assert f"and {smallest.host_bytes / GIB:.2f} GiB of host memory" in message
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
    budget = int(on_gpu.peak[1].reserved - 2 * GIB)  # the batch-8 activations no longer fit
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
