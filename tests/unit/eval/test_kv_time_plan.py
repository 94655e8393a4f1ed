"""The KV benchmark's time plan (benchmarks/kv/_kv_plan.py): one device call of ~540 s on an H200 gives every throughput
row a cap, the accuracy parts their seconds and the retrieval model's training the rest.

The H200 call at bdfe903 planned 12 s for each QuantizedCache row but let the rows before it overrun (MiniCache
merge + 4-bit: 15 s against 8) and skipped both QuantizedCache rows for time. Now the plan's seconds are those the
rows took there, no row is skipped, and a row behind the plan takes fewer timed steps (at least one) instead."""

import argparse

import pytest

from benchmarks.kv import _kv_plan as plan_module
from benchmarks.kv._kv_throughput import ROWS
from benchmarks.kv._kv_timing import steps_within


def h200_plan(budget=473.0, real_here=True):
    return plan_module.time_plan(budget, ROWS, [32768, 65536], real_here, host_gib=64, train_max=200)


# The H200 call at bdfe903 (benchmarks/kv/results.jsonl#kv_eval): (label, context) -> (seconds, timed steps, median s a
# step); the full cache's seconds hold four timings of 6 steps (the dispatcher's choice and three forced backends).
H200_ROWS = {
    ("full", 32768): (4.2, 6, 0.038), ("full", 65536): (3.5, 6, 0.038),
    ("shadowkv", 32768): (3.8, 6, 0.128), ("shadowkv", 65536): (3.6, 6, 0.172),
    ("minicache_merge_4bit", 32768): (15.0, 3, 0.291), ("minicache_merge_4bit", 65536): (14.7, 3, 0.294),
    ("kvpress_pruned", 32768): (2.2, 6, 0.141), ("kvpress_pruned", 65536): (2.3, 6, 0.156),
    ("minicache_4bit_only", 32768): (8.4, 3, 0.252), ("minicache_4bit_only", 65536): (9.9, 3, 0.282),
    ("minicache_merge", 32768): (7.9, 6, 0.331), ("minicache_merge", 65536): (10.3, 6, 0.336),
    ("full_repeat", 32768): (2.2, 6, 0.039), ("full_repeat", 65536): (3.3, 6, 0.044),
    ("minicache_merge_4bit_restore", 32768): (11.9, 3, 1.090), ("minicache_merge_4bit_restore", 65536): (14.0, 4, 1.099),
}
SLOW_ROWS = {"minicache_merge_4bit_restore": 2, "quantized_cache_4bit": 2}  # timed steps their plan holds


@pytest.mark.parametrize("row", sorted(H200_ROWS))
def test_each_rows_planned_seconds_hold_what_it_took_on_the_h200(row):
    """Build + 2 warm-up + its timed steps + the profiled step, at the step time the H200 measured: the plan at
    bdfe903 gave MiniCache merge + 4-bit 8 s where its build alone took 13."""
    seconds, steps, step = H200_ROWS[row]
    planned = h200_plan().rows[row]
    if row[0] in ("full", "full_repeat", "shadowkv", "kvpress_pruned"):
        assert planned >= seconds  # cheap rows: all --steps steps
        return
    build = seconds - (2 + steps + 1) * step
    keep = SLOW_ROWS.get(row[0], plan_module.MIN_STEPS)
    assert planned >= build + (2 + keep + 1) * step, (row, planned, build)


def test_quantized_cache_rows_have_more_than_the_h100_took():
    plan = h200_plan()
    assert plan.rows[("quantized_cache_4bit", 32768)] >= 8.9 and plan.rows[("quantized_cache_4bit", 65536)] >= 8.7


def test_every_row_at_every_context_has_a_cap_and_the_plan_fits_the_budget():
    plan = h200_plan()
    assert set(plan.rows) == {(label, ctx) for label in ROWS for ctx in (32768, 65536)}
    assert all(seconds > 0 for seconds in plan.rows.values())
    total = plan.setup + plan.train + plan.throughput + plan.accuracy + plan.real + plan.close
    assert total <= plan.budget
    assert plan.real > 0 and plan.train >= plan_module.MIN_TRAIN_SECONDS


def test_the_slow_rows_run_last_and_the_full_cache_again_after_the_minicache_rows():
    assert ROWS[0] == "full" and set(ROWS[-2:]) == {"quantized_cache_4bit", "minicache_merge_4bit_restore"}
    assert ROWS.index("full_repeat") > max(ROWS.index(r) for r in ROWS if r.startswith("minicache_") and "restore" not in r)


def test_the_training_gets_what_the_other_parts_leave_and_the_real_model_its_seconds_only_when_here():
    with_real, without = h200_plan(), h200_plan(real_here=False)
    assert without.real == 0
    assert without.train == pytest.approx(min(200, with_real.train + with_real.real))
    assert h200_plan(budget=10_000).train == 200  # never above --train-seconds


def test_the_plan_prints_one_line_a_part_and_a_row_and_warns_when_the_training_is_short():
    lines = h200_plan().lines()
    assert lines[0].startswith("time plan: 473 s budget")
    assert sum(line.startswith("plan: ctx ") for line in lines) == 2 * len(ROWS)
    assert any("quantized_cache_4bit" in line for line in lines)
    assert any("warning" in line for line in h200_plan(budget=300).lines())
    assert not any("warning" in line for line in h200_plan(budget=10_000).lines())


def test_a_row_keeps_its_planned_seconds_on_schedule_and_gets_its_share_when_behind():
    plan = h200_plan()
    order = list(plan.rows)
    first, later = order[0], order[1:]
    on_time = plan.after_rows() + plan.throughput + 5
    assert plan.cap(first, later, on_time) == plan.rows[first]
    remaining = sum(plan.rows.values())
    half = plan.after_rows() + plan_module.ROW_GAP_SECONDS * len(order) + remaining / 2
    assert plan.cap(first, later, half) == pytest.approx(plan.rows[first] / 2)
    assert plan.cap(order[-1], [], 0.0) == 0.0  # nothing left: the row still runs, on one timed step


@pytest.mark.parametrize("seconds_left, step, most, expected", [
    (None, 1.0, 6, 6),  # no deadline: --steps
    (100.0, 0.05, 6, 6),  # room for more than --steps
    (5.0, 1.0, 6, 4),  # 5 s at 1 s a step, the profiled step left room for
    (0.5, 1.7, 6, 1),  # past the cap: one timed step (the old plan kept three: 5 s of a slow row)
    (2.0, 1.09, 6, 1),  # the restore path's step with 2 s left
    (0.0, 0.04, 6, 3),  # cheap steps: three whatever the cap
    (0.0, 0.04, 2, 2),  # never more than --steps
])
def test_timed_steps_fit_the_rows_cap_down_to_one(seconds_left, step, most, expected, monkeypatch):
    import time

    monkeypatch.setattr(time, "time", lambda: 1000.0)
    deadline = None if seconds_left is None else 1000.0 + seconds_left
    assert steps_within(deadline, step, most) == expected


@pytest.mark.slow
def test_no_row_is_skipped_when_the_run_is_out_of_time(monkeypatch):
    """Every row of the tiny stand-in, with the run's time already spent: each is measured (at least one timed
    step), records its cap and says when its steps were cut; none is skipped (the old guard skipped them all)."""
    from benchmarks.kv import _kv_throughput
    from benchmarks.kv._kv_common import DEADLINE

    monkeypatch.setattr(DEADLINE, "left", lambda: 0.0)
    args = argparse.Namespace(smoke="tiny", contexts=[128], steps=3, host_gib=0.05, margin_gib=0.5)
    plan = plan_module.time_plan(0.0, ROWS, args.contexts, False, host_gib=0.05, train_max=5)
    import torch

    out = _kv_throughput.throughput_part(args, lambda msg: None, torch.device("cpu"), plan=plan)
    rows = out["contexts"]["128"]
    assert list(rows) == list(ROWS)
    for label, row in rows.items():
        assert "skipped" not in row, (label, row)
        if "error" in row:  # an optional package missing (optimum-quanto): the reason is kept
            assert row["error"].strip(), label
            continue
        if label in _kv_throughput.CUDA_ONLY_ROWS and not torch.cuda.is_available():
            assert row["needs_cuda"] == _kv_throughput.GRAPH_NEEDS_CUDA, (label, row)
            continue
        assert row["tokens_per_s"] > 0 and row["timed_steps"] >= 1, label
        assert row["cap_seconds"] == 0.0 and row["planned_seconds"] > 0, label
        assert row["timed_steps"] == 3 or row["steps_cut"].startswith(f"{row['timed_steps']} of 3"), (label, row)
