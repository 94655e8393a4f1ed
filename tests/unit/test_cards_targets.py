"""The cards benchmark's timing targets: what ``weights: auto`` and a 12 GB card reach against dense on a big
card, and how far the fit's step-time model is from every timing row it predicted."""

from __future__ import annotations

from benchmarks.cards.cards import TARGETS, TIMING, targets_of


def test_the_timing_runs_cover_every_budget_and_batch_the_model_is_held_to():
    budgets = {(budget, batch) for budget, batch, _ in TIMING.values()}
    assert {("none", 1), (11, 1), (7, 1), (5, 1), ("none", 8), (11, 8), (7, 8)} <= budgets
    budget, batch, overrides = TIMING["b1_dense"]  # the dense reference: the recipe with its weights pinned dense
    assert (budget, batch, overrides) == ("none", 1, ("memory.weights=dense",))
    assert all(not extra for name, (_, _, extra) in TIMING.items() if name != "b1_dense")  # the shipped recipe as is


def test_the_speed_targets_and_the_step_time_error_come_from_the_timing_rows():
    timing = {"b1_dense": {"tokens_per_s": 3000.0, "predicted_tokens_per_s": 3114.0},
              "b1_none": {"tokens_per_s": 2970.0, "predicted_tokens_per_s": 3114.0},
              "b1_11": {"tokens_per_s": 2550.0, "predicted_tokens_per_s": 1686.0},
              "b8_none": {"tokens_per_s": 8200.0}}  # a row without the fit's prediction is not counted
    targets, _ = targets_of([], timing)
    assert targets["auto_unbounded_over_dense_tokens_per_s_batch1"] == {"value": 0.99, "goal": ">= 0.98", "met": True}
    assert targets["card_12gb_over_dense_unbounded_tokens_per_s_batch1"] == {"value": 0.85, "goal": ">= 0.90",
                                                                             "met": False}
    error = targets["fit_step_time_max_relative_error"]
    assert error["at"] == "b1_11" and error["rows"] == 3 and error["met"] is False
    assert error["value"] == round(abs(1686 / 2550 - 1), 3)
    assert targets["card_12gb_over_unbounded_tokens_per_s"]["value"] == round(2550 / 2970, 3)  # kept
    assert set(targets) <= set(TARGETS)


def test_a_6_gb_card_at_batch_8_is_timed_against_no_budget():
    assert TIMING["b8_5"] == (5, 8, ())  # the shipped recipe: the fit chunks the MLP to fit
    targets, _ = targets_of([], {"b8_none": {"tokens_per_s": 7000.0}, "b8_5": {"tokens_per_s": 6440.0}})
    assert targets["card_6gb_over_unbounded_tokens_per_s_batch8"] == {"value": 0.92, "goal": ">= 0.9", "met": True}
    assert "card_6gb_over_unbounded_tokens_per_s_batch8" in TARGETS
    targets, _ = targets_of([], {"b8_5": {"tokens_per_s": 6440.0}})  # no unbounded row in the call: no ratio
    assert "card_6gb_over_unbounded_tokens_per_s_batch8" not in targets
