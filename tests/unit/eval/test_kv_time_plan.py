"""The KV benchmark's time plan (benchmarks/_kv_plan.py): one device call of ~540 s on an H200 gives every throughput
row a cap and at least three timed steps, the accuracy parts their seconds and the retrieval model's training the
rest. The H200 run at d100cd9 spent its budget in order and skipped eight rows and the real model."""

import pytest

from benchmarks import _kv_plan as plan_module
from benchmarks._kv_throughput import ROWS, steps_within


def h200_plan(budget=515.0, real_here=True):
    return plan_module.time_plan(budget, ROWS, [32768, 65536], real_here, host_gib=64, train_max=200)


def test_every_row_at_every_context_has_a_cap_and_the_plan_fits_the_budget():
    plan = h200_plan()
    assert set(plan.rows) == {(label, ctx) for label in ROWS for ctx in (32768, 65536)}
    assert all(seconds > 0 for seconds in plan.rows.values())
    total = plan.setup + plan.train + plan.throughput + plan.accuracy + plan.real + plan.close
    assert total <= plan.budget
    assert plan.real > 0 and plan.train >= plan_module.MIN_TRAIN_SECONDS


def test_the_training_gets_what_the_other_parts_leave_and_the_real_model_its_seconds_only_when_here():
    with_real, without = h200_plan(), h200_plan(real_here=False)
    assert without.real == 0
    assert without.train == pytest.approx(min(200, with_real.train + with_real.real))
    assert h200_plan(budget=10_000).train == 200  # never above --train-seconds


def test_the_plan_prints_one_line_a_part_and_a_row():
    lines = h200_plan().lines()
    assert lines[0].startswith("time plan: 515 s budget")
    assert sum(line.startswith("plan: ctx ") for line in lines) == 2 * len(ROWS)
    assert any("quantized_cache_4bit" in line for line in lines)


@pytest.mark.parametrize("seconds_left, step, most, expected", [
    (None, 1.0, 6, 6),  # no deadline: --steps
    (100.0, 0.05, 6, 6),  # room for more than --steps
    (5.0, 1.0, 6, 4),  # 5 s at 1 s a step, the profiled step left room for
    (0.5, 1.7, 6, 3),  # past the cap: still the minimum
])
def test_timed_steps_fit_the_rows_cap_but_never_fall_under_three(seconds_left, step, most, expected, monkeypatch):
    import time

    monkeypatch.setattr(time, "time", lambda: 1000.0)
    deadline = None if seconds_left is None else 1000.0 + seconds_left
    assert steps_within(deadline, step, most) == expected
