"""The kernel timeline of a profiled block (benchmarks/memory/_timeline.py) on a synthetic Chrome trace whose busy, idle and
gap figures are known, and the graphed KV rows' replay timeline (benchmarks/kv/_kv_graph.py), which records a profiler
failure in the row instead of raising it (the row's timing is kept)."""

import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.kv import _kv_graph
from benchmarks.kv._kv_graph import SHADOWKV_KERNEL_GROUPS, replay_timeline
from benchmarks.memory._timeline import busy_and_gaps, group_of, kernel_intervals, profile_kernels, timeline_table

GEMV, FUSED, GATHER = "ampere_bf16_gemv_kernel", "_shadowkv_fused_decode_kernel", "_gather_chunks_kernel"

# Two steps of three kernels: the fused kernel overlaps the GEMV by 5 us (another stream), then an idle gap before
# the gather (5 us in step 1, 25 us in step 2) and 75 us between the steps.
KERNELS = [(GEMV, 0.0, 10.0), (FUSED, 5.0, 10.0), (GATHER, 20.0, 5.0),
           (GEMV, 100.0, 10.0), (FUSED, 105.0, 10.0), (GATHER, 140.0, 5.0)]


def _trace(tmp_path, kernels=KERNELS):
    events = [{"ph": "X", "cat": "kernel", "name": n, "ts": ts, "dur": dur, "pid": 0, "tid": 7}
              for n, ts, dur in kernels]
    events.reverse()  # the file's order is not the timeline's
    events += [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": 500.0},
               {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 50.0, "dur": 20.0},
               {"ph": "i", "cat": "kernel", "name": "marker", "ts": 60.0}]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_kernel_intervals_keeps_the_kernels_in_start_order(tmp_path):
    assert kernel_intervals(_trace(tmp_path)) == KERNELS


def test_busy_idle_and_gaps_per_step(tmp_path):
    table = timeline_table(kernel_intervals(_trace(tmp_path)), steps=2)
    # busy: [0, 15] + [20, 25] + [100, 115] + [140, 145] = 40 us; span 145 us; gaps 5, 75, 25
    assert table["kernels_per_step"] == 3
    assert table["span_us_per_step"] == 72.5
    assert table["busy_us_per_step"] == 20
    assert table["idle_us_per_step"] == 52.5
    assert table["gaps"] == {"count_per_step": 1.5, "median_us": 25.0, "p90_us": 25.0, "over_10us_per_step": 1.0}
    assert "product_bytes_per_s" not in table  # no weight bytes given


def test_default_groups_and_the_kernel_table():
    table = timeline_table(KERNELS, steps=2)
    assert list(table["group_us_per_step"].items()) == [("other", 15.0), ("product", 10.0)]  # most time first
    assert [(r["kernel"], r["group"], r["per_step"], r["us_per_step"], r["median_us"]) for r in table["top"]] == [
        (GEMV, "product", 1.0, 10.0, 10.0), (FUSED, "other", 1.0, 10.0, 10.0), (GATHER, "other", 1.0, 5.0, 5.0)]


def test_extra_groups_go_ahead_of_the_defaults():
    table = timeline_table(KERNELS, steps=2, groups=SHADOWKV_KERNEL_GROUPS, weight_bytes=1e6)
    assert table["group_us_per_step"] == {"product": 10.0, "shadowkv_fused_attention": 10.0, "shadowkv_gather": 5.0}
    assert table["product_bytes_per_s"] == pytest.approx(1e6 / 10e-6)  # 1 MB over 10 us of products a step
    # a Triton reduction would be a pointwise kernel by default; a caller's top-k group claims it first
    topk = (("selection_topk", re.compile("topk")),)
    assert group_of("triton_red_fused_topk_0") == "norm_and_pointwise"
    assert group_of("triton_red_fused_topk_0", topk) == "selection_topk"
    assert group_of("void at::native::sbtopk::gatherTopK<float>", SHADOWKV_KERNEL_GROUPS) == "shadowkv_selection"


def test_top_keeps_the_most_device_time_and_no_kernels_is_an_error():
    assert [r["kernel"] for r in timeline_table(KERNELS, steps=2, top=1)["top"]] == [GEMV]
    assert timeline_table([], steps=3) == {"error": "the trace holds no kernel events"}
    assert timeline_table(KERNELS, steps=2, weight_bytes=1e6, groups=(("all", re.compile(".")),))[
        "product_bytes_per_s"] is None  # no product kernels: no bandwidth


def test_profile_kernels_runs_the_block_and_keeps_the_trace(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # CPU activity only: no kernel events
    calls = []
    kernels = profile_kernels(lambda: calls.append(torch.ones(4).sum()), 3, trace_gz=tmp_path / "t.json.gz")
    assert kernels == [] and len(calls) == 3
    assert (tmp_path / "t.json.gz").stat().st_size > 0


def test_replay_timeline_records_the_table(monkeypatch):
    monkeypatch.setattr(_kv_graph, "profile_kernels", lambda step, n: KERNELS)
    out = replay_timeline(lambda: None, cuda=True, groups=SHADOWKV_KERNEL_GROUPS, replays=2)
    timeline = out["replay_timeline"]
    assert set(out) == {"replay_timeline"} and timeline["replays"] == 2
    assert timeline["busy_us_per_step"] == 20 and timeline["kernels_per_step"] == 3
    assert timeline["group_us_per_step"]["shadowkv_gather"] == 5.0


def test_a_profiler_failure_is_recorded_not_raised(monkeypatch):
    def fail(step, n):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED: the profiler could not trace the graph")

    monkeypatch.setattr(_kv_graph, "profile_kernels", fail)
    assert replay_timeline(lambda: None, cuda=True) == {
        "replay_timeline_error": "RuntimeError: CUPTI_ERROR_NOT_INITIALIZED: the profiler could not trace the graph"}


def test_a_failing_replay_or_an_empty_trace_is_recorded(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def replay():
        raise ValueError("the graph's tail is full")

    assert replay_timeline(replay, cuda=True) == {"replay_timeline_error": "ValueError: the graph's tail is full"}
    # the real profiler on the CPU: the block runs, its trace holds no kernels
    assert replay_timeline(lambda: torch.ones(2) + 1, cuda=True, replays=1) == {
        "replay_timeline_error": "the trace holds no kernel events"}


def test_without_cuda_the_row_says_why():
    assert set(replay_timeline(lambda: None, cuda=False)) == {"replay_timeline_skipped"}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 12)), min_size=1, max_size=12))  # kernels last > 0
def test_busy_and_gaps_is_the_union_of_the_intervals_and_the_holes_between_them(pairs):
    """Against a count of covered unit cells: the union (busy), the holes inside the span (gaps), the span."""
    intervals = sorted((start, start + length) for start, length in pairs)
    span, busy, gaps = busy_and_gaps(intervals)
    first, last = intervals[0][0], max(end for _, end in intervals)
    covered = [any(a <= t < b for a, b in intervals) for t in range(first, last)]
    assert span == last - first and busy == sum(covered)
    holes, run = [], 0  # maximal runs of uncovered cells, in order
    for cell in covered:
        if not cell:
            run += 1
        elif run:
            holes.append(run)
            run = 0
    assert gaps == holes
