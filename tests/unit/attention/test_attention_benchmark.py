"""benchmarks/attention/_attention_table.py: the attention benchmark's rows -> dispatch entries naming the faster Sage
kernel, and attention.json's four targets (made-up rows, no GPU)."""

from __future__ import annotations

import pytest

from benchmarks.attention import _attention_table as table
from benchmarks.attention import sage_fidelity
from neutrain.attention import dispatch

DEV = "NVIDIA H200"
FOUR = {"fwd_over_cudnn_min", "fwd_bwd_over_cudnn_min", "train_step_over_sdpa", "sage_fwd_tops_n16k_d128"}


def _rows(speed, lengths=(4096, 8192, 16384), gluon_skipped=None):
    """Rows of a sweep where cuDNN takes 10 ms forward and 40 ms forward+backward at every point, and each
    kernel's time is cuDNN's divided by ``speed(kernel, n, causal)`` (the cuDNN backward route 4 ms behind
    that, the Triton backward route 3x slower)."""
    rows = []
    for n in lengths:
        for causal in (False, True):
            rows.append({"n": n, "causal": causal, "method": "sdpa_cudnn", "fwd_ms": 10.0, "fwd_bwd_ms": 40.0})
            for kernel in table.KERNELS:
                if kernel == "gluon" and gluon_skipped:
                    rows.append({"n": n, "causal": causal, "method": "gluon_kernel", "skipped": gluon_skipped})
                    continue
                s = speed(kernel, n, causal)
                rows.append({"n": n, "causal": causal, "method": table.KERNEL_ROW[kernel], "fwd_ms": 9.0 / s,
                             "fwd_tops": 900.0 * s, "quant_ms": 1.0})
                for route, fb in (("cudnn", 40.0 / s), ("triton", 120.0 / s)):
                    rows.append({"n": n, "causal": causal, "method": table.method_name(kernel, route), "kernel": kernel,
                                 "backward": route, "fwd_ms": 10.0 / s, "fwd_bwd_ms": fb})
    return rows


def _gluon_wins_long(kernel, n, causal):
    if kernel == "triton":
        return 0.8
    return 1.4 if n >= 8192 else 0.9


def _lookup(entries, n, causal=True, mode="forward"):
    return dispatch.lookup(DEV, 128, causal, "bfloat16", mode, n, tuple(entries))


def test_entries_name_gluon_where_it_is_faster_and_send_calls_to_sage_only_across_wins():
    entries, left_out = table.build_table(DEV, 128, _rows(_gluon_wins_long), margin=1.02)
    assert not left_out
    assert all(e["kernel"] in dispatch.KERNELS for e in entries)
    for mode in dispatch.MODES:
        for causal in (False, True):
            long = _lookup(entries, 12288, causal, mode)
            assert (long.backend, long.kernel) == ("sage", "gluon")
            assert _lookup(entries, 4096, causal, mode).backend == "sdpa"   # both kernels slower there
            assert _lookup(entries, 6144, causal, mode).backend == "sdpa"   # a loss at one end: not proven
    assert _lookup(entries, 16384, mode="train").backward == "cudnn"       # the faster route of the winner
    short = next(e for e in entries if e["seq_min"] == e["seq_max"] == 4096)
    assert short["backend"] == "sdpa" and short["kernel"] == "gluon"       # the faster Sage kernel, under SDPA
    for e in entries:  # both kernels' times are kept as evidence; every sage pick was measured faster
        assert all(set(ev["sage_ms_by_kernel"]) == {"triton", "gluon"} for ev in e["evidence"])
        if e["backend"] == "sage":
            assert all(ev["speedup"] >= 1.02 and ev["sage_ms_by_kernel"][e["kernel"]] == ev["sage_ms"]
                       for ev in e["evidence"])


def test_the_faster_kernel_wins_a_range_even_when_neither_beats_sdpa():
    entries, _ = table.build_table(DEV, 128, _rows(lambda k, n, c: 0.9 if k == "triton" else 0.7), margin=1.02)
    assert {e["backend"] for e in entries} == {"sdpa"}
    assert {e["kernel"] for e in entries} == {"triton"}


def test_gluon_skipped_leaves_a_triton_table_and_says_nothing_is_left_out():
    entries, left_out = table.build_table(DEV, 128, _rows(lambda k, n, c: 1.2, gluon_skipped="capability 8.0"), 1.02)
    assert {e["kernel"] for e in entries} == {"triton"} and {e["backend"] for e in entries} == {"sage"}
    assert not left_out


def test_a_kernel_missing_at_some_length_is_left_out_of_that_family():
    rows = [r for r in _rows(lambda k, n, c: 1.2)
            if not (r.get("kernel") == "gluon" and r["n"] == 4096 and r["causal"])]
    entries, left_out = table.build_table(DEV, 128, rows, 1.02)
    assert "causal=True train gluon" in left_out
    assert {e["kernel"] for e in entries if e["causal"] and e["mode"] == "train"} == {"triton"}


def test_targets_are_exactly_the_four_with_the_one_shared_goal_definition():
    assert set(table.ATTENTION_GOALS) == FOUR
    assert sage_fidelity.ATTENTION_GOALS is table.ATTENTION_GOALS
    # The fidelity record adds its own: O's cosine against fp32 on the real model's activations.
    assert set(sage_fidelity.attention_targets()) == FOUR | {"sage_o_cosine_min"}
    rows = _rows(_gluon_wins_long)
    entries, _ = table.build_table(DEV, 128, rows, 1.02)
    step = {"rows": [{"variant": "sage", "kernel": "gluon", "backward_route": "cudnn"}, {"variant": "cudnn"}],
            "speedup_vs_cudnn": {"8192": 1.01, "16384": 1.04}}
    tg = table.targets(rows, step, entries, 128)
    assert set(tg) == FOUR
    for name, t in tg.items():
        assert t["goal"] == table.ATTENTION_GOALS[name] and t["method"]
    # Gluon is dispatched at every N >= 8K: 10 / (10 / 1.4) forward, 40 / (40 / 1.4) forward+backward.
    assert tg["fwd_over_cudnn_min"]["value"] == pytest.approx(1.4) and tg["fwd_over_cudnn_min"]["met"] is True
    assert {p["kernel"] for p in tg["fwd_over_cudnn_min"]["per_point"]} == {"gluon"}
    assert all(p["n"] >= 8192 for p in tg["fwd_bwd_over_cudnn_min"]["per_point"])  # the 4K losses are not read
    assert tg["fwd_bwd_over_cudnn_min"]["value"] == pytest.approx(1.4)
    assert "note" not in tg["fwd_over_cudnn_min"]
    assert tg["train_step_over_sdpa"]["value"] == pytest.approx(1.04) and tg["train_step_over_sdpa"]["met"] is True
    assert "gluon" in tg["train_step_over_sdpa"]["method"]
    assert tg["sage_fwd_tops_n16k_d128"]["value"] == pytest.approx(900.0 * 1.4)
    assert tg["sage_fwd_tops_n16k_d128"]["met"] is True
    assert tg["sage_fwd_tops_n16k_d128"]["by_kernel"] == {"triton": 720.0, "gluon": 1260.0}


def test_targets_say_so_when_dispatch_picks_sdpa_everywhere():
    rows = _rows(lambda k, n, c: {"triton": 0.6, "gluon": 0.8}[k] if c else {"triton": 0.7, "gluon": 0.9}[k])
    entries, _ = table.build_table(DEV, 128, rows, 1.02)
    tg = table.targets(rows, None, entries, 128)
    fwd = tg["fwd_over_cudnn_min"]
    assert fwd["value"] == pytest.approx(0.8) and fwd["met"] is False  # the best Sage kernel's worst point
    assert "SDPA" in fwd["note"] and fwd["worst"]["kernel"] == "gluon" and fwd["worst"]["causal"] is True
    assert tg["train_step_over_sdpa"]["value"] is None and tg["train_step_over_sdpa"]["met"] is None
    assert tg["train_step_over_sdpa"]["note"]


def test_targets_of_another_head_dim_are_unmeasured():
    rows = _rows(_gluon_wins_long)
    entries, _ = table.build_table(DEV, 64, rows, 1.02)
    tg = table.targets(rows, None, entries, 64)
    assert set(tg) == FOUR and all(t["value"] is None and "d=64" in t["note"] for t in tg.values())


def test_training_step_runs_the_fastest_causal_kernel_and_route():
    choice = table.train_step_choice(_rows(_gluon_wins_long))
    assert (choice["kernel"], choice["backward"]) == ("gluon", "cudnn")
    assert table.train_step_choice([])["kernel"] == "triton"


def test_train_entries_name_only_the_routes_that_passed_the_fidelity_gate():
    # cuDNN's backward is 3x faster in these rows, but a route that misses the gradient gate on real
    # activations must never be what auto trains with: with only the Triton route admitted, gluon's
    # forward + Triton backward (120/1.4 = 86 ms against cuDNN SDPA's 40) loses and SDPA trains.
    rows = _rows(_gluon_wins_long)
    entries, _ = table.build_table(DEV, 128, rows, margin=1.02, train_routes=["triton"])
    train = [e for e in entries if e["mode"] == "train"]
    assert train and all(e["backward"] == "triton" for e in train)
    assert _lookup(entries, 16384, mode="train").backend == "sdpa"
    assert _lookup(entries, 16384, mode="forward").backend == "sage"   # the forward needs no backward route
    choice = table.train_step_choice(rows, ["triton"])
    assert (choice["kernel"], choice["backward"]) == ("gluon", "triton")


@pytest.mark.slow
def test_the_training_step_benchmark_imports_as_the_device_runs_it():
    # The device runs the script by path (benchmarks/ first on sys.path); a name it imports from a sibling
    # module that no longer exists fails only there, after the sweep has spent its time.
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run([sys.executable, "benchmarks/attention/attention_train_step.py", "--help"], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _auto_step(model, sdpa_s, auto_s, auto_counters):
    """An ``attention_train_step.py --variants auto,sdpa`` record with the given step times per length."""
    rows = [{"variant": "auto", **{seq: {"step_s": t, "counters": auto_counters} for seq, t in auto_s.items()}},
            {"variant": "sdpa", **{seq: {"step_s": t, "counters": {}} for seq, t in sdpa_s.items()}}]
    from benchmarks.attention.attention_train_step import speedups

    seqs = [int(s) for s in auto_s]
    return {"model": model, "rows": rows, "auto_over_sdpa": speedups(rows, seqs, "sdpa", "auto")}


def test_the_auto_step_check_takes_the_least_ratio_over_every_model_and_length():
    counters = {"fallback": 64, "fallback:dispatch table: sdpa": 64}
    big = _auto_step("8b", {"1024": 1.0, "8192": 2.0}, {"1024": 1.0, "8192": 2.1}, counters)
    small = _auto_step("default", {"256": 0.02}, {"256": 0.019}, counters)
    summary = table.auto_step_summary([big, small])
    assert summary["auto_train_step"]["8b"]["auto_over_sdpa"] == {"1024": 1.0, "8192": pytest.approx(2.0 / 2.1)}
    assert summary["auto_over_sdpa_min"] == pytest.approx(2.0 / 2.1)
    assert summary["auto_train_step"]["default"]["auto_kernels"] == {"256": {"fallback": 64}}
    # A later fold of one model keeps the other's and recomputes the least ratio.
    again = table.auto_step_summary([_auto_step("8b", {"1024": 1.0}, {"1024": 0.99}, counters)],
                                    summary["auto_train_step"])
    assert set(again["auto_train_step"]) == {"8b", "default"}
    assert again["auto_over_sdpa_min"] == pytest.approx(1.0 / 0.99)  # default's 0.02 / 0.019 is larger


def test_the_training_step_reads_the_default_recipes_model_and_batch():
    from benchmarks.attention.attention_train_step import model_config

    config, batch = model_config("default")
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"], batch) == (256, 4, 4096, 8)
    assert "model_type" not in config and model_config("8b")[1] == 1


def test_records_of_one_model_merge_and_a_refold_replaces_only_the_models_it_names():
    counters = {"fallback": 8, "fallback:dispatch table: sdpa": 8}
    short = _auto_step("8b", {"1024": 1.0}, {"1024": 1.02}, counters)
    long = _auto_step("8b", {"8192": 2.0, "16384": 4.0}, {"8192": 2.0, "16384": 4.1}, counters)
    small = _auto_step("default", {"256": 0.02}, {"256": 0.02}, counters)
    first = table.auto_step_summary([short, long, small])
    assert set(first["auto_train_step"]["8b"]["auto_over_sdpa"]) == {"1024", "8192", "16384"}
    assert set(first["auto_train_step"]["8b"]["auto_kernels"]) == {"1024", "8192", "16384"}
    assert len(first["auto_train_step"]["8b"]["rows"]) == 4
    assert first["auto_over_sdpa_min"] == pytest.approx(4.0 / 4.1)  # 16K: the least of 1/1.02, 1, 4/4.1
    again = table.auto_step_summary([_auto_step("8b", {"8192": 2.0}, {"8192": 1.9}, counters)],
                                    first["auto_train_step"])
    assert set(again["auto_train_step"]["8b"]["auto_over_sdpa"]) == {"8192"}  # the model's old lengths go
    assert again["auto_train_step"]["default"] == first["auto_train_step"]["default"]


def test_rounds_run_the_variants_a_b_b_a_and_the_step_time_is_the_median_over_rounds(monkeypatch):
    import json
    import subprocess

    from benchmarks.attention import attention_train_step as step

    calls, times = [], {"auto": iter([1.0, 3.0, 2.0]), "sdpa": iter([2.0, 2.0, 2.0])}

    def fake_run(cmd, **kwargs):
        variant = cmd[cmd.index("--child") + 1]
        calls.append((variant, kwargs["env"]["NEUTRAIN_SAGE_DISPATCH"]))
        row = {"variant": variant, "256": {"step_s": next(times[variant])}}
        return subprocess.CompletedProcess(cmd, 0, stdout="RESULT " + json.dumps(row), stderr="")

    monkeypatch.setattr(step.subprocess, "run", fake_run)
    rows = step.run(["auto", "sdpa"], [256], 5, "default", "triton", 10.0, rounds=3)
    assert calls == [("auto", "table"), ("sdpa", "table"), ("sdpa", "table"), ("auto", "table"),
                     ("auto", "table"), ("sdpa", "table")]
    assert [r["round"] for r in rows] == [0, 0, 1, 1, 2, 2]
    assert step.speedups(rows, [256], "sdpa", "auto") == {"256": 1.0}  # auto's median of 1, 3, 2 is 2


def test_a_ratio_under_one_by_less_than_the_rounds_own_spread_is_not_a_slowdown():
    def row(variant, step_s, losses):
        return {"variant": variant, "16384": {"step_s": step_s, "losses": losses, "counters": {}}}

    same, other = [12.5, 12.4], [12.5, 12.41]
    rows = [row("auto", 2.618, same), row("sdpa", 2.620, same), row("sdpa", 2.626, same), row("auto", 2.633, same)]
    step = {"model": "8b", "rows": rows, "auto_over_sdpa": {"16384": 2.623 / 2.6255}}  # medians: 0.999
    summary = table.auto_step_summary([step])
    entry = summary["auto_train_step"]["8b"]
    assert entry["round_spread"]["16384"] == pytest.approx(2.633 / 2.618 - 1)
    assert entry["losses_identical"] == {"16384": True}
    assert summary["auto_never_slower_within_spread"] is True
    rows[3] = row("auto", 2.90, other)  # auto's second round 10 % slower: its spread is that large too
    step["auto_over_sdpa"] = {"16384": 2.623 / 2.759}
    assert table.auto_step_summary([step])["auto_never_slower_within_spread"] is True
    tight = [row("auto", 2.80, same), row("sdpa", 2.62, same), row("sdpa", 2.621, same), row("auto", 2.81, same)]
    slow = table.auto_step_summary([{"model": "8b", "rows": tight, "auto_over_sdpa": {"16384": 2.6205 / 2.805}}])
    assert slow["auto_never_slower_within_spread"] is False  # 7 % slower, rounds within 0.4 %
    assert table.auto_step_summary([step])["auto_train_step"]["8b"]["losses_identical"] == {"16384": False}
