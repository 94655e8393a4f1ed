"""Benchmark records say which code they measured and against which goals.

Every committed ``benchmarks/results/*.json`` carries a real commit (never "unknown"),
whether the tree was dirty, and a ``targets`` object; ``write_result`` refuses to write
a record without them; junit files written with ``--junitxml`` carry the commit.
Superseded or hand-edited records live in ``benchmarks/results/archive/`` with a note.
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

from benchmarks import _common

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
ARCHIVE = RESULTS / "archive"
SHA = re.compile(r"[0-9a-f]{7,40}")


@pytest.mark.parametrize("path", sorted([*RESULTS.glob("*.json"), *(RESULTS / "profiles").glob("*.json")]),
                         ids=lambda p: p.name)
def test_committed_records_name_their_commit_dirty_flag_and_targets(path: Path):
    data = json.loads(path.read_text())
    assert SHA.fullmatch(str(data.get("git_commit"))), f"{path.name}: git_commit {data.get('git_commit')!r}"
    assert "git_dirty" in data, f"{path.name}: no git_dirty"
    assert data["git_dirty"] in (True, False) or data.get("git_dirty_note"), f"{path.name}: unknown git_dirty needs a note"
    targets = data.get("targets")
    assert isinstance(targets, dict), f"{path.name}: no targets object"
    for name, entry in targets.items():
        assert {"value", "goal"} <= set(entry), f"{path.name}: targets[{name!r}] lacks value or goal"
    assert targets or data.get("targets_note"), f"{path.name}: empty targets need a targets_note saying why"


def test_every_archived_record_is_listed_with_its_reason():
    listed = (ARCHIVE / "README.md").read_text()
    files = sorted(p.name for p in ARCHIVE.iterdir() if p.name != "README.md")
    assert files, "the archive is empty"
    assert [f for f in files if f"`{f}`" not in listed] == []


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
    from benchmarks._kv_targets import real_targets

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
    from benchmarks._spec_decode import GOALS, RETIRED_TARGETS, SUPERSEDED_GOALS

    targets = json.loads((RESULTS / f"{name}.json").read_text())["targets"]
    assert targets.keys() - RETIRED_TARGETS.keys() == GOALS.keys()
    for key, target in targets.items():
        goals = {GOALS.get(key), RETIRED_TARGETS.get(key), *SUPERSEDED_GOALS.get(key, ())}
        assert target["goal"] in goals, (key, target["goal"])


def test_step_anatomy_reports_memory_targets_only_for_the_setting_they_name():
    from types import SimpleNamespace

    from benchmarks.step_anatomy import targets_of

    memory = {"peak_allocated_gib": 12.3, "peak_reserved_gib": 12.46, "device_used_gib": 13.68}
    got = targets_of(SimpleNamespace(variant="d", batch=1, tiny=False), memory)
    assert got["d_device_used_gib_batch1"]["met"] and not got["d_peak_reserved_gib_batch1"]["met"]
    assert targets_of(SimpleNamespace(variant="d", batch=8, tiny=False), memory) == {}
    assert targets_of(SimpleNamespace(variant="c", batch=1, tiny=False), memory) == {}


def test_a_kv_study_names_every_target_and_values_only_what_it_measured():
    # A diagnostic or a sweep (benchmarks/diag/minicache_*.py) records the eight KV targets by name, like
    # kv_eval.json: the real-model gap where it evaluated the benchmark's setting, the rest with no value.
    from benchmarks._kv_targets import REAL_GOALS, kv_targets, targets_of_a_study

    names = {*kv_targets({}), *REAL_GOALS}
    sweep = targets_of_a_study({"real": {"gap_points": {"full": 0.0, "minicache_merge": 100.0}}}, "a sweep")
    assert set(sweep) == names and len(names) == 8
    assert sweep["real_model_minicache_acc_gap_points"]["value"] == 100.0
    assert sweep["real_model_minicache_acc_gap_points"]["met"] is False
    assert all(e["not_measured"] == "a sweep" for n, e in sweep.items() if n != "real_model_minicache_acc_gap_points")
    layers = targets_of_a_study({}, "per-layer errors")
    assert set(layers) == names and all(e["value"] is None and e["goal"] for e in layers.values())
