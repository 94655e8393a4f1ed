"""The automatic fit: a card of each size gets the fastest configuration that fits it.

The 8B recipe (``memory.weights: auto``, LOMO, checkpointing) on fake cards of 24, 16, 12 and 8 GB and on
the budgets the lead's GPU script uses (22, 14.5, 11 and 7 GiB, and 5 for a 6 GB card): dense weights
where they fit, NeuZip where they must, then layers and activations in host memory; of the configurations
that fit, the one with the shortest predicted step (:mod:`neutrain.memory.step_time`). A key the user set
is never changed; nothing fitting is one RecipeError naming the smallest budget and host memory that
would. Planner only: no model is built.
"""

from __future__ import annotations

import dataclasses

import pytest

from neutrain.config import RecipeError, load_recipe
from neutrain.memory import step_time
from neutrain.memory.budget import AUTO_MARGIN_BYTES, auto_budget, resolve_budget
from neutrain.memory.fit import FIT_HEADROOM, TIE_SHARE, apply_changes, candidates, choose_fit, link_cost
from neutrain.memory import plan_recipe
from neutrain.memory import CUDA_CONTEXT_BYTES, GIB

DENSE, NEUZIP = "dense weights on the GPU", "NeuZip weights on the GPU"
ACT, WEIGHTS, BOTH = ("NeuZip weights, offloading activations", "NeuZip weights, offloading weights",
                      "NeuZip weights, offloading weights and activations")
LAYERS = "of 32 decoder layers' weights"  # a part of the layers in host memory
HOST = 64 * GIB


def _8b(*overrides: str):
    return load_recipe("recipes/llama3_8b.yaml", list(overrides))


def _kind(label: str) -> str:
    if LAYERS in label:
        return "layers+act" if "offloading activations and" in label else "layers"
    return label


def _assert_fastest_that_fits(fit, budget):
    """Every phase fits; no configuration the fit could take fits and is predicted faster (beyond a tie)."""
    assert all(e.reserved <= budget * (1 - FIT_HEADROOM) for e in fit.plan.values())  # every phase, not only the peak
    tried = fit.as_dict()["tried"]
    assert [t["chosen"] for t in tried].count(True) == 1
    for row in tried:
        if row["fits"]:
            assert row["predicted_tokens_per_s"] <= fit.step.tokens_per_s * (1 + TIE_SHARE) + 1e-6, (row, fit.label)


@pytest.mark.parametrize("card_gb, batch, expected", [
    (24, 1, DENSE), (16, 1, NEUZIP), (12, 1, "layers"), (8, 1, "layers"),
    # 16 GB at batch 8: NeuZip on the GPU holds the vocabulary slot all step (its layers decode as groups into
    # it, neutrain.nn.groups), so with activations offloaded it no longer fits; streaming 9 layers does.
    (24, 8, DENSE), (16, 8, "layers"), (12, 8, "layers"), (8, 8, BOTH),
])
def test_a_fake_card_of_each_size_picks_the_fastest_configuration_that_fits(card_gb, batch, expected):
    budget = resolve_budget("auto", card_gb * 10**9)  # as torch reports a card: bytes
    assert budget == card_gb * 10**9 - CUDA_CONTEXT_BYTES - AUTO_MARGIN_BYTES
    fit = choose_fit(_8b(f"train.micro_batch_size={batch}"), budget, HOST)
    assert _kind(fit.label) == expected, fit.line
    _assert_fastest_that_fits(fit, budget)
    weights = "dense" if expected == DENSE else "neuzip-lossless"
    assert fit.weights == weights and fit.changes["memory.weights"] == weights
    assert fit.line.startswith(f"memory: weights {weights} (")
    assert f"predicted {fit.step.tokens_per_s:,.0f} tok/s" in fit.line


def test_a_12gb_card_keeps_most_layers_on_the_gpu():
    # 11 GiB, batch 1: the 8B needs 16.8 GiB dense and 12.2 GiB NeuZip on the GPU. Streaming every layer (what the
    # fit did before it had levers between) ran at 0.67-0.76x of the unbounded speed; a few layers in host memory fit.
    recipe = _8b("memory.device_budget_gib=11")
    fit = choose_fit(recipe, resolve_budget(recipe.memory.device_budget_gib, 80 * GIB), HOST)
    chosen = apply_changes(recipe, fit.changes)
    assert chosen.memory.weights == "neuzip-lossless" and chosen.memory.offload_weights
    assert not chosen.memory.offload_activations
    assert 3 <= chosen.memory.offload_layers <= 16, fit.line  # a part of the 32 layers, spread between the others
    assert fit.label == f"NeuZip weights, offloading {chosen.memory.offload_layers} of 32 decoder layers' weights"
    assert fit.line.startswith(f"memory: weights neuzip-lossless (dense needs 16.78 GiB), offloading "
                               f"{chosen.memory.offload_layers} {LAYERS}: on the GPU it needs 12.")
    record = fit.as_dict()
    assert record["offloaded_layers"] == list(fit.plan["train_step"].settings["offloaded"])
    assert len(record["offloaded_layers"]) == chosen.memory.offload_layers
    assert record["weights"] == "neuzip-lossless" and record["predicted_tokens_per_s"] == fit.step.tokens_per_s
    every_layer = plan_recipe(apply_changes(recipe, {"memory.weights": "neuzip-lossless", "memory.offload_weights": True}))
    assert fit.link_bytes < link_cost(every_layer["train_step"]) / 3  # a third of the bytes, or fewer
    _assert_fastest_that_fits(fit, 11 * GIB)


def test_a_6gb_card_runs_every_phase_at_5_gib():
    fit = choose_fit(_8b("memory.device_budget_gib=5"), 5 * GIB, HOST)
    assert fit.changes.get("memory.offload_weights") is True
    assert all(e.reserved <= 5 * GIB * (1 - FIT_HEADROOM) for e in fit.plan.values())


@pytest.mark.parametrize("budget_gib, batch, expected", [
    (22, 1, DENSE), (14.5, 1, NEUZIP), (11, 1, "layers"), (7, 1, "layers"), (5, 1, WEIGHTS),
    (22, 8, DENSE), (14.5, 8, ACT), (11, 8, "layers"), (7, 8, "layers+act"),
])
def test_the_lead_script_budgets_pick_the_expected_configuration(budget_gib, batch, expected):
    recipe = _8b(f"train.micro_batch_size={batch}", f"memory.device_budget_gib={budget_gib}")
    budget = resolve_budget(recipe.memory.device_budget_gib, 80 * GIB)
    assert budget == int(budget_gib * GIB)
    fit = choose_fit(recipe, budget, HOST)
    assert _kind(fit.label) == expected, fit.line
    _assert_fastest_that_fits(fit, budget)
    chosen = apply_changes(recipe, fit.changes)
    assert chosen.memory.weights == ("dense" if expected == DENSE else "neuzip-lossless")
    assert chosen.memory.offload_weights == (expected in ("layers", "layers+act", WEIGHTS, BOTH))
    assert chosen.memory.offload_activations == (expected in (ACT, "layers+act", BOTH))
    assert (chosen.memory.offload_layers is None) == (expected not in ("layers", "layers+act"))
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
    # offload_weights and offload_layers set: the layers stay as given (NeuZip, the only weights the host store
    # holds), only activation offload may change.
    given = _8b("memory.offload_weights=true", "memory.offload_layers=20")
    assert {c.get("memory.offload_layers", 20) for _, c in candidates(given)} == {20}
    assert [label for label, _ in candidates(given)] == [f"NeuZip weights, offloading 20 {LAYERS}",
                                                         f"NeuZip weights, offloading activations and 20 {LAYERS}"]
    # Both offload keys pinned: nothing fits 7 GiB, and the error says what would.
    pinned = _8b("memory.offload_activations=false", "memory.offload_weights=false")
    with pytest.raises(RecipeError) as err:
        choose_fit(pinned, 7 * GIB, HOST)
    assert "nothing fits a budget of 7.00 GiB" in str(err.value)
    neuzip = plan_recipe(apply_changes(pinned, {"memory.weights": "neuzip-lossless"}))
    assert f"({NEUZIP}) {_needs(neuzip)}" in str(err.value)


def test_the_weights_follow_memory_weights_auto_and_an_explicit_storage_is_kept():
    big, small = resolve_budget("auto", 80 * 10**9), resolve_budget("auto", 16 * 10**9)
    assert choose_fit(_8b(), big, HOST).weights == "dense"  # auto: dense where it fits
    assert choose_fit(_8b(), small, HOST).weights == "neuzip-lossless"  # NeuZip where it must
    forced = choose_fit(_8b("memory.weights=neuzip-lossless"), big, HOST)  # compression forced, even on a big card
    assert forced.weights == "neuzip-lossless" and "memory.weights" not in forced.changes
    assert forced.line.startswith("memory: fits the ")  # no weights clause: the recipe chose them
    smallest = r"the smallest configuration \(offloading activations, the MLP in chunks of 512 tokens\)"
    with pytest.raises(RecipeError, match=smallest):
        choose_fit(_8b("memory.weights=dense"), small, HOST)  # dense kept: it does not fit a 16 GB card
    # NeuZip needs a fused optimizer: with AdamW, auto is dense whatever the card.
    assert [label for label, _ in candidates(_8b("train.optimizer=adamw"), gpu=False)] == ["dense weights in memory"]


def test_the_fit_follows_the_predicted_step_time_not_the_bytes(monkeypatch):
    # At batch 8 with the batch keys free, under 14.5 GiB: offloading (a few GiB over PCIe) against a smaller
    # micro-batch with accumulation (no PCIe bytes, twice the host's launches). On the H200's rates offloading is
    # faster; with a link 50 times slower the same configurations rank the other way, and the fit follows.
    recipe = _8b("train.micro_batch_size=8", "memory.weights=neuzip-lossless")
    recipe = recipe.model_copy(
        update={"explicit": recipe.explicit - {"train.micro_batch_size", "train.gradient_accumulation_steps"}})
    fast_link = choose_fit(recipe, int(14.5 * GIB), HOST)
    assert fast_link.changes.get("memory.offload_activations") or fast_link.changes.get("memory.offload_weights")
    assert "train.micro_batch_size" not in fast_link.changes, fast_link.line
    slow = dataclasses.replace(step_time.GPU, link_bytes_per_s=step_time.GPU.link_bytes_per_s / 50)
    monkeypatch.setattr("neutrain.memory.fit.GPU", slow)
    slow_link = choose_fit(recipe, int(14.5 * GIB), HOST)
    assert slow_link.changes["train.micro_batch_size"] == 4, slow_link.line
    assert slow_link.label.startswith("micro_batch_size 4 x 2 accumulation steps (8 rows a step)")
    _assert_fastest_that_fits(slow_link, int(14.5 * GIB))


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
    acts = plan_recipe(apply_changes(recipe, {"memory.weights": "neuzip-lossless", "memory.offload_activations": True}))
    assert "nothing fits a budget of 11.00 GiB" in str(err.value)
    assert f"({ACT}) {_needs(acts)}" in str(err.value)


def test_nothing_fits_names_the_smallest_budget_and_host_memory():
    with pytest.raises(RecipeError) as err:
        choose_fit(_8b(), 3 * GIB, HOST)
    message = str(err.value)
    assert "\n" not in message and message.startswith("memory.device_budget_gib: nothing fits a budget of 3.00 GiB")
    # The smallest: every layer's weights and the activations in host memory, two weight slots, and the MLP
    # whole or in the smallest chunks, whichever needs less (at 1,024 tokens the chunked MLP's held weight
    # costs more than its chunks save), named with its figures.
    tight = ("memory.weights=neuzip-lossless", "memory.offload_weights=true", "memory.offload_activations=true",
             "memory.offload_slots=2")
    whole, chunked = plan_recipe(_8b(*tight)), plan_recipe(_8b(*tight, "memory.mlp_chunk_tokens=512"))
    assert whole["train_step"].reserved < chunked["train_step"].reserved
    smallest = whole
    assert f"the smallest configuration ({BOTH}, 2 weight slots on the GPU) {_needs(smallest)}" in message
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
    recipe = recipe.model_copy(
        update={"explicit": recipe.explicit - {"train.micro_batch_size", "train.gradient_accumulation_steps"}})
    labels = [label for label, _ in candidates(recipe)]
    assert labels[:2] == ["on the GPU", "offloading activations"] and not any("weights" in label for label in labels)
    on_gpu = choose_fit(recipe, 80 * GIB, HOST)
    assert on_gpu.label == "on the GPU"
    acts = plan_recipe(apply_changes(recipe, {"memory.offload_activations": True}))
    budget = int(max(e.reserved for e in acts.values()) / (1 - FIT_HEADROOM)) - 1  # just too small for 8 rows at once
    fit = choose_fit(recipe, budget, HOST)
    chosen = apply_changes(recipe, fit.changes)
    assert chosen.train.micro_batch_size < 8
    assert chosen.train.micro_batch_size * chosen.train.gradient_accumulation_steps == 8
    assert fit.label.startswith(f"micro_batch_size {chosen.train.micro_batch_size} x ")
    _assert_fastest_that_fits(fit, budget)


def test_no_budget_keeps_the_recipe_and_resolves_auto_weights_against_the_card_or_host():
    assert resolve_budget("none", 80 * GIB) is None and resolve_budget("auto", None) is None
    assert resolve_budget("auto", 80 * GIB) == auto_budget(80 * GIB)
    fit = choose_fit(_8b("memory.weights=neuzip-lossless"), None, HOST)
    assert fit.changes == {} and "no device budget" in fit.line
    # auto with no budget: only the weights change, dense where the card (or a CPU's host) holds it.
    on_h200 = choose_fit(_8b(), None, HOST, card=143 * 10**9)
    assert on_h200.changes == {"memory.weights": "dense"}
    assert on_h200.line.startswith("memory: weights dense (needs 16.78 GiB of the card's ")
    assert "NeuZip would be used below 17.66 GiB" in on_h200.line and "tok/s" in on_h200.line
    assert choose_fit(_8b(), None, HOST, card=16 * 10**9).changes == {"memory.weights": "neuzip-lossless"}
    on_cpu = choose_fit(_8b(), None, 12 * GIB, gpu=False)  # a host with 12 GiB: dense (16.8 GiB) does not fit
    assert on_cpu.changes == {"memory.weights": "neuzip-lossless"} and "the host's 12.00 GiB" in on_cpu.line
    # On a CPU nothing is offloaded: only the weights and the micro-batch may change.
    assert [label for label, _ in candidates(_8b(), gpu=False)] == ["dense weights in memory", "NeuZip weights in memory"]


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
