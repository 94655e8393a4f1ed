"""Benchmark records say which code they measured and against which goals.

Every current row of a topic's table (``benchmarks/<topic>/results.jsonl``) carries a real commit (never
"unknown"), whether the tree was dirty, and a ``targets`` object; ``write_result`` refuses to write a record
without them; junit files written with ``--junitxml`` carry the commit, and their rows in
``benchmarks/gpu_tests.jsonl`` keep it. A row set aside says why (``archived``) or has a newer row of its name.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from benchmarks import _common, records

ROOT = Path(__file__).resolve().parents[2]
SHA = re.compile(r"[0-9a-f]{7,40}")
ROWS = records.rows()
CURRENT = [r for r in ROWS if r["current"]]


def test_no_record_file_is_named_by_commit_and_every_topic_has_its_table():
    # The commit is a column of the tables, never part of a file's name.
    named = [str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").rglob("*")
             if re.search(r"(?<![0-9a-z])[0-9a-f]{7,40}(?![0-9a-z])", p.name)]
    assert named == []
    assert not (ROOT / "benchmarks" / "results").exists(), "run `python benchmarks/records.py migrate`"
    assert all(records.table_path(t).exists() for t in records.TOPICS)


@pytest.mark.parametrize("data", CURRENT, ids=lambda r: r["name"])
def test_current_records_name_their_commit_dirty_flag_and_targets(data: dict):
    name = data["name"]
    assert SHA.fullmatch(str(data.get("git_commit"))), f"{name}: git_commit {data.get('git_commit')!r}"
    assert "git_dirty" in data, f"{name}: no git_dirty"
    assert data["git_dirty"] in (True, False) or data.get("git_dirty_note"), f"{name}: unknown git_dirty needs a note"
    targets = data.get("targets")
    assert isinstance(targets, dict), f"{name}: no targets object"
    for target, entry in targets.items():
        assert {"value", "goal"} <= set(entry), f"{name}: targets[{target!r}] lacks value or goal"
    assert targets or data.get("targets_note"), f"{name}: empty targets need a targets_note saying why"


def test_each_name_has_at_most_one_current_row_and_every_other_row_says_why():
    names = [r["name"] for r in CURRENT]
    assert len(names) == len(set(names))
    unexplained = [r["name"] for r in ROWS if not r["current"] and not r.get("archived") and r["name"] not in names]
    assert unexplained == [], "rows set aside without a reason (`archived`) or a newer row of their name"


def test_junit_rows_keep_the_suites_counts_and_the_commit():
    rows = [r for r in records.read_table(records.GPU_TESTS) if r["kind"] == "junit"]
    assert rows
    for row in rows:
        assert row["git_commit"] is None or SHA.fullmatch(row["git_commit"]), row["source"]
        assert row["suites"] and all({"name", "tests", "failures"} <= s.keys() for s in row["suites"]), row["source"]
        assert len(row["tests"]) == sum(int(s["tests"] or 0) for s in row["suites"]), row["source"]


def test_migrate_folds_legacy_files_once_and_removes_them(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "BENCH", tmp_path)
    monkeypatch.setattr(records, "GPU_TESTS", tmp_path / "gpu_tests.jsonl")
    legacy = tmp_path / "results"
    (legacy / "archive").mkdir(parents=True)
    record = {"name": "codec", "git_commit": "abc1234", "git_dirty": False, "date": "2026-01-02", "targets": {},
              "targets_note": "none", "settings": {}, "results": {"x": 1}}
    (legacy / "codec.json").write_text(json.dumps(record))
    (legacy / "archive" / "codec_0123abc.json").write_text(json.dumps({**record, "git_commit": "0123abc"}))
    (legacy / "archive" / "README.md").write_text("| `codec_0123abc.json` | an older run | codec.json |\n")
    (legacy / "junit_gpu_abc1234.xml").write_text(
        '<testsuites><testsuite name="gpu" tests="1" failures="0" errors="0" skipped="0">'
        '<testcase classname="t" name="a" time="0.1"/></testsuite></testsuites>')
    copy = tmp_path / "copy"
    import shutil
    shutil.copytree(legacy, copy)
    assert records.migrate(legacy, log=lambda *a: None) == 3 and not legacy.exists()
    table = records.read_table(tmp_path / "codec" / "results.jsonl")
    assert [(r["git_commit"], r["current"], r.get("archived")) for r in table] == [
        ("0123abc", False, "an older run (superseded by codec.json)"), ("abc1234", True, None)]
    assert records.current("codec")["results"] == {"x": 1}
    junit = records.read_table(tmp_path / "gpu_tests.jsonl")
    assert (junit[0]["name"], junit[0]["git_commit"], junit[0]["tests"][0]["outcome"]) == ("junit_gpu", "abc1234", "passed")
    records.migrate(copy, log=lambda *a: None)  # the same files again: nothing new
    assert records.read_table(tmp_path / "codec" / "results.jsonl") == table


def test_a_new_record_becomes_current_and_keeps_the_old_as_history(tmp_path, monkeypatch, no_out):
    monkeypatch.setattr(records, "BENCH", tmp_path)
    monkeypatch.setenv("NEUTRAIN_GIT_DIRTY", "0")
    for commit in ("abc1234", "def5678"):
        monkeypatch.setenv("NEUTRAIN_GIT_COMMIT", commit)
        assert _common.write_result("codec", {}, {"commit": commit}) == tmp_path / "codec" / "results.jsonl"
    table = records.read_table(tmp_path / "codec" / "results.jsonl")
    assert [(r["git_commit"], r["current"]) for r in table] == [("abc1234", False), ("def5678", True)]
    assert records.current("codec")["results"] == {"commit": "def5678"}
    assert records.find("codec", "abc")["results"] == {"commit": "abc1234"}


def test_a_run_that_writes_as_it_goes_leaves_one_row(tmp_path, monkeypatch, no_out):
    # attention.py rewrites its record after every length of the sweep: one run, one row
    monkeypatch.setattr(records, "BENCH", tmp_path)
    monkeypatch.setenv("NEUTRAIN_GIT_COMMIT", "abc1234")
    monkeypatch.setenv("NEUTRAIN_GIT_DIRTY", "0")
    for lengths in ([1024], [1024, 2048]):
        _common.write_result("attention", {}, {"lengths": lengths})
    monkeypatch.setattr(_common, "RUN_ID", "another process")
    _common.write_result("attention", {}, {"lengths": [1024]})
    table = records.read_table(tmp_path / "attention" / "results.jsonl")
    assert [(r["results"]["lengths"], r["current"]) for r in table] == [([1024, 2048], False), ([1024], True)]


@pytest.fixture
def no_out(monkeypatch):
    monkeypatch.delenv("OUT", raising=False)  # write_result also copies to $OUT on the device machine


def test_write_result_refuses_an_unknown_commit(tmp_path, monkeypatch, no_out):
    monkeypatch.setenv("NEUTRAIN_GIT_COMMIT", "unknown")
    monkeypatch.setenv("NEUTRAIN_GIT_DIRTY", "0")
    with pytest.raises(_common.ProvenanceError, match="NEUTRAIN_GIT_COMMIT"):
        _common.write_result("x", {}, {}, out_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_commit_from_the_environment_needs_the_dirty_flag_too(monkeypatch):
    # A device copy's .git may be stale, so `git status` there cannot say whether the tree was dirty.
    monkeypatch.setenv("NEUTRAIN_GIT_COMMIT", "abc1234")
    monkeypatch.delenv("NEUTRAIN_GIT_DIRTY", raising=False)
    with pytest.raises(_common.ProvenanceError, match="NEUTRAIN_GIT_DIRTY"):
        _common.git_provenance()


def test_a_dirty_flag_without_a_commit_is_refused(monkeypatch):
    # NEUTRAIN_GIT_COMMIT=$(cat missing) gives "": git would answer from a stale device .git, vouched clean.
    monkeypatch.setenv("NEUTRAIN_GIT_COMMIT", "")
    monkeypatch.setenv("NEUTRAIN_GIT_DIRTY", "0")
    monkeypatch.setattr(_common, "_git", lambda *args: "0123456789abcdef0123456789abcdef01234567\n")
    with pytest.raises(_common.ProvenanceError, match="NEUTRAIN_GIT_COMMIT is empty"):
        _common.git_provenance()


def test_without_the_environment_git_answers(monkeypatch):
    monkeypatch.delenv("NEUTRAIN_GIT_COMMIT", raising=False)
    monkeypatch.delenv("NEUTRAIN_GIT_DIRTY", raising=False)
    answers = {"rev-parse": "0123456789abcdef0123456789abcdef01234567\n", "status": " M neutrain/trainer/trainer.py\n"}
    monkeypatch.setattr(_common, "_git", lambda *args: answers[args[0]])
    assert _common.git_provenance() == ("0123456789abcdef0123456789abcdef01234567", True)
    answers["status"] = ""
    assert _common.git_provenance()[1] is False

    def no_git(*args):
        raise subprocess.CalledProcessError(128, ["git", *args])

    monkeypatch.setattr(_common, "_git", no_git)
    with pytest.raises(_common.ProvenanceError, match="NEUTRAIN_GIT_COMMIT"):
        _common.git_provenance()


def test_write_result_records_commit_dirty_flag_and_targets(tmp_path, monkeypatch, no_out):
    monkeypatch.setenv("NEUTRAIN_GIT_COMMIT", "abc1234")
    monkeypatch.setenv("NEUTRAIN_GIT_DIRTY", "1")
    targets = {"bits_per_weight": {"value": 10.69, "goal": "<= 10.9"}}
    path = _common.write_result("x", {"n": 1}, {"bits_per_weight": 10.69}, out_dir=tmp_path, targets=targets)
    data = json.loads(path.read_text())
    assert (data["git_commit"], data["git_dirty"], data["targets"]) == ("abc1234", True, targets)
    assert "targets_note" not in data

    path = _common.write_result("y", {}, {}, out_dir=tmp_path)
    data = json.loads(path.read_text())
    assert data["targets"] == {} and data["targets_note"]


@pytest.mark.parametrize("targets", [{"x": 1.0}, {"x": {"value": 1.0}}, [("x", 1.0)]])
def test_malformed_targets_are_refused_before_anything_is_written(tmp_path, monkeypatch, no_out, targets):
    monkeypatch.setenv("NEUTRAIN_GIT_COMMIT", "abc1234")
    monkeypatch.setenv("NEUTRAIN_GIT_DIRTY", "0")
    with pytest.raises((TypeError, ValueError)):
        _common.write_result("x", {}, {}, out_dir=tmp_path, targets=targets)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_junit_files_record_the_commit(tmp_path):
    env = {**os.environ, "NEUTRAIN_GIT_COMMIT": "abcdef1", "NEUTRAIN_GIT_DIRTY": "1"}
    junit = tmp_path / "junit.xml"
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                          "tests/test_docs.py::test_the_docs_index_lists_every_note"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    props = {p.get("name"): p.get("value") for p in ET.parse(junit).getroot().iter("property")}
    assert props == {"git_commit": "abcdef1", "git_dirty": "true"}


def test_real_model_targets_name_their_setting_and_the_ones_not_measured():
    from benchmarks.kv._kv_targets import real_targets

    both = real_targets({"real": {"gap_points": {"full": 0.0, "shadowkv_paper_chunk4": 5.0,
                                                 "shadowkv_paper_scaled": 45.0, "minicache_merge": 90.0}}})
    shadow = both["real_model_shadowkv_acc_gap_points"]
    assert (shadow["value"], shadow["setting"], shadow["met"]) == (45.0, "shadowkv_paper_scaled", False)
    assert both["real_model_minicache_acc_gap_points"]["value"] == 90.0
    finer = real_targets({"real": {"gap_points": {"full": 0.0, "shadowkv_paper_chunk4": 5.0}}})
    assert finer["real_model_shadowkv_acc_gap_points"]["setting"] == "shadowkv_paper_chunk4"
    assert finer["real_model_minicache_acc_gap_points"]["value"] is None  # named, not invented
    other = real_targets({"real": {"gap_points": {"full": 0.0, "shadowkv_budget_6pct_chunk4": 5.0}}})
    assert all(t["value"] is None for t in other.values())  # a 6.25% budget is not the target's setting
    assert real_targets({}) == {}


@pytest.mark.parametrize("name", ["speculative", "speculative_rounds"])
def test_decode_records_name_every_target_with_its_goal(name):
    # speculative_rounds measures a round's cost on random weights: it names the targets without values.
    # A record measured before a goal changed keeps the goal it was measured against (named in
    # SUPERSEDED_GOALS) and may name targets since retired (RETIRED_TARGETS); every other goal is today's.
    from benchmarks.decode._spec_decode import GOALS, RETIRED_TARGETS, SUPERSEDED_GOALS

    targets = records.current(name)["targets"]
    assert targets.keys() - RETIRED_TARGETS.keys() == GOALS.keys()
    for key, target in targets.items():
        goals = {GOALS.get(key), RETIRED_TARGETS.get(key), *SUPERSEDED_GOALS.get(key, ())}
        assert target["goal"] in goals, (key, target["goal"])


def test_step_anatomy_reports_memory_targets_only_for_the_setting_they_name():
    from types import SimpleNamespace

    from benchmarks.memory.step_anatomy import targets_of

    memory = {"peak_allocated_gib": 12.3, "peak_reserved_gib": 12.46, "device_used_gib": 13.68}
    got = targets_of(SimpleNamespace(variant="d", batch=1, tiny=False), memory)
    assert got["d_device_used_gib_batch1"]["met"] and not got["d_peak_reserved_gib_batch1"]["met"]
    assert targets_of(SimpleNamespace(variant="d", batch=8, tiny=False), memory) == {}
    assert targets_of(SimpleNamespace(variant="c", batch=1, tiny=False), memory) == {}


def test_a_kv_study_names_every_target_and_values_only_what_it_measured():
    # A diagnostic or a sweep (benchmarks/kv/minicache_*.py) records the eight KV targets by name, like
    # kv_eval.json: the real-model gap where it evaluated the benchmark's setting, the rest with no value.
    from benchmarks.kv._kv_targets import REAL_GOALS, kv_targets, targets_of_a_study

    names = {*kv_targets({}), *REAL_GOALS}
    sweep = targets_of_a_study({"real": {"gap_points": {"full": 0.0, "minicache_merge": 100.0}}}, "a sweep")
    assert set(sweep) == names and len(names) == 8
    assert sweep["real_model_minicache_acc_gap_points"]["value"] == 100.0
    assert sweep["real_model_minicache_acc_gap_points"]["met"] is False
    assert all(e["not_measured"] == "a sweep" for n, e in sweep.items() if n != "real_model_minicache_acc_gap_points")
    layers = targets_of_a_study({}, "per-layer errors")
    assert set(layers) == names and all(e["value"] is None and e["goal"] for e in layers.values())
