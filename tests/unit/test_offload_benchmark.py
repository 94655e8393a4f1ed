"""benchmarks/offload/offload.py runs each part in its own process: a part that dies costs only its own record."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import child_env

from benchmarks.offload import offload, offload_recipe
from benchmarks._isolated import failure_line, run_part

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str) -> list[str]:
    """A child command: ``code`` runs with the record path as ``sys.argv[1]`` and the repo importable."""
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r})\n" + textwrap.dedent(code)]


def test_a_part_that_aborts_like_a_cuda_fault_is_one_failed_line_and_the_next_part_still_runs():
    # What the 8B's offloaded part did: an AcceleratorError, then an abort in a destructor (SIGABRT).
    crash = _python("""
        import os
        print("8b offloaded: step 1", flush=True)
        sys.stderr.write("Traceback (most recent call last):\\n  File 'x', line 1\\n"
                         "torch.AcceleratorError: CUDA error: an illegal memory access was encountered\\n"
                         "terminate called after throwing an instance of 'c10::AcceleratorError'\\n")
        sys.stderr.flush()
        os.abort()
    """)
    row = run_part("8b_offload", crash, echo=False)
    assert row == {"failed": "torch.AcceleratorError: CUDA error: an illegal memory access was encountered "
                             "(exit -6)", "returncode": -6}
    ok = _python("""
        from benchmarks._isolated import child
        child(lambda: {"tokens_per_s": 6771.3}, sys.argv[1])
    """)
    assert run_part("8b_gpu", ok, echo=False) == {"tokens_per_s": 6771.3}


def test_a_part_that_raises_writes_its_own_failure_record_before_leaving():
    raises = _python("""
        from benchmarks._isolated import child
        def part():
            raise RuntimeError("CUDA error: an illegal memory access was encountered\\nmore")
        child(part, sys.argv[1])
    """)
    row = run_part("70b", raises, echo=False)
    assert row == {"failed": "RuntimeError: CUDA error: an illegal memory access was encountered"}


@pytest.mark.slow
def test_a_part_past_its_time_limit_is_recorded_as_a_timeout():
    sleeps = _python("import time; time.sleep(30)")
    row = run_part("70b", sleeps, timeout=2, echo=False)
    assert row["returncode"] == 124 and "TimeoutError: part 70b ran past 2 s" in row["failed"]


def test_failure_line_prefers_the_raised_error_and_names_a_signal():
    assert failure_line("", -9) == "no output (signal 9)"
    assert failure_line("warning: x\nKilled\n", 137) == "Killed (exit 137)"


def test_the_8b_processes_fill_one_record_and_a_failed_half_sets_no_target():
    results: dict = {}
    offload.store_part(results, "8b_gpu", {"tokens_per_s": 100.0})
    offload.store_part(results, "8b_offload", {"failed": "torch.AcceleratorError: ...", "returncode": -6})
    offload.store_part(results, "link", {"h2d_gb_s": 50.0})
    assert results == {"8b": {"in_gpu": {"tokens_per_s": 100.0},
                              "offloaded": {"failed": "torch.AcceleratorError: ...", "returncode": -6}},
                       "link": {"h2d_gb_s": 50.0}}
    assert offload.targets_of(results, full_70b=False) == {}
    offload.store_part(results, "8b_offload", {"tokens_per_s": 90.0})
    assert offload.targets_of(results, False)["offload_8b_over_in_gpu"]["value"] == 0.9
    offload.store_part(results, "8b_offload", {"tokens_per_s": 90.0, "sync_debug": True})
    assert offload.targets_of(results, False) == {}  # a debug run's timings are no measurement


@pytest.mark.slow
def test_an_unknown_part_is_refused_in_one_line():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "offload" / "offload.py"), "--parts", "8b,bogus"],
                          capture_output=True, text=True, env=child_env(NEUTRAIN_GIT_COMMIT="0" * 40, NEUTRAIN_GIT_DIRTY="0"),
                          check=False)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "'bogus'" in proc.stderr


def _run_dir(path: Path, steps: list[int], *, checkpoint: int | None = None) -> Path:
    """A run directory as `neutrain train` leaves it: metrics.jsonl, summary.json, maybe a checkpoint."""
    import json

    path.mkdir(parents=True)
    lines = [json.dumps({"step": s, "loss": 10.0 - s, "tokens_per_second": 600.0 + s, "peak_reserved_gib": 40.0})
             for s in steps]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (path / "summary.json").write_text(json.dumps({"peak_reserved_gib": 41.5}))
    if checkpoint is not None:
        ckpt = path / f"checkpoint-{checkpoint}"
        ckpt.mkdir()
        (ckpt / "config.json").write_text("{}")
        (ckpt / "model.safetensors").write_bytes(b"\0" * 4096)
    return path


def _offload_recipe(tmp_path: Path, monkeypatch, *args: str) -> tuple[int, dict]:
    """``python benchmarks/offload/offload_recipe.py ARGS`` with ``$OUT`` set: (exit code, the offload.json it wrote).

    In this process: the script only reads and writes JSON, and a child process spent seconds importing torch
    (``benchmarks._common``) for it."""
    import json

    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    results = tmp_path / "results"  # never the repository's benchmarks/results
    results.mkdir(exist_ok=True)
    for name, value in {"OUT": str(out), "NEUTRAIN_GIT_COMMIT": "0" * 40, "NEUTRAIN_GIT_DIRTY": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["offload_recipe.py", *args, "--results-dir", str(results)])
    rc = offload_recipe.main()
    record = out / "offload.json"
    return rc, (json.loads(record.read_text()) if record.exists() else {})


def test_the_70b_gate_needs_train_resume_and_export_each_with_exit_code_zero(tmp_path, monkeypatch, capsys):
    train = _run_dir(tmp_path / "train", [1, 2, 3, 4])
    resume = _run_dir(tmp_path / "resume", [5], checkpoint=5)
    # The first run's checkpoint was deleted after the resume (to make room for the export): its record stands in.
    record = tmp_path / "checkpoint.json"
    saved = _run_dir(tmp_path / "kept", [], checkpoint=4) / "checkpoint-4"
    monkeypatch.setattr(sys, "argv", ["offload_recipe.py", "--describe", str(saved)])
    capsys.readouterr()
    assert offload_recipe.main() == 0
    record.write_text(capsys.readouterr().out)
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text("{}")
    (export / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 64)
    stages = tmp_path / "stages.txt"
    common = ["--train", str(train), "--resume", str(resume), "--steps", "4", "--stages", str(stages),
              "--checkpoint-record", str(record), "--export", str(export)]

    stages.write_text("train_s=300\ntrain_rc=0\nresume_s=200\nresume_rc=0\nexport_s=100\nexport_rc=0\n")
    rc, out = _offload_recipe(tmp_path, monkeypatch, *common)
    result = out["results"]["70b_recipe"]
    assert rc == 0 and result["gate_ok"] is True, out
    assert result["checkpoint_saved"] is True and result["stage_exit_codes"] == {"train": 0, "resume": 0, "export": 0}
    assert result["export_neuzip"]["saved"] and result["export_neuzip"]["safetensors_files"] == 1
    assert out["targets"]["h100_70b_tokens_per_s_16k"]["value"] == 603.0  # median of steps 2-4 (after the first)

    stages.write_text("train_s=300\ntrain_rc=0\nresume_s=200\nresume_rc=0\nexport_s=100\nexport_rc=1\n")
    rc, out = _offload_recipe(tmp_path, monkeypatch, *common)
    assert rc == 1 and out["results"]["70b_recipe"]["gate_ok"] is False


def test_a_part_kept_from_an_earlier_record_keeps_the_commit_and_date_it_was_measured_at(tmp_path, monkeypatch):
    import json

    train = _run_dir(tmp_path / "train", [1, 2, 3, 4])
    resume = _run_dir(tmp_path / "resume", [5], checkpoint=5)
    (tmp_path / "out").mkdir()
    earlier = {"git_commit": "a" * 40, "date": "2026-01-02T03:04:05+00:00", "device": "an earlier card",
               "settings": {}, "targets": {}, "results": {"8b": {"tokens_per_s": 1.0}}}
    (tmp_path / "out" / "offload.json").write_text(json.dumps(earlier))
    stages = tmp_path / "stages.txt"
    stages.write_text("train_s=300\ntrain_rc=0\nresume_s=200\nresume_rc=0\n")
    rc, out = _offload_recipe(tmp_path, monkeypatch, "--train", str(train), "--resume", str(resume), "--steps", "4",
                              "--stages", str(stages))
    assert out["results"]["8b"] == {"tokens_per_s": 1.0} and "70b_recipe" in out["results"], out
    assert out["git_commit"] == "0" * 40  # this run's
    assert out["settings"]["kept_parts"] == {"8b": {"git_commit": "a" * 40, "date": "2026-01-02T03:04:05+00:00",
                                                    "device": "an earlier card"}}


def _host_part(tmp_path: Path, budget, rates, exit_code=0) -> Path:
    import json

    label = "unbounded" if budget is None else f"{budget:g}gib"
    train = {"step_rates": [{"step": k + 1, "tokens_per_second": r} for k, r in enumerate(rates)],
             "tokens_per_s": sum(rates) / len(rates)}
    record = {"run_id": f"r-{label}", "git_commit": "abc", "device": "NVIDIA H200",
              "results": {f"70b_recipe_{label}_host": {"budget_gib": budget, "runs": {"train": train},
                                                       "stages": {"train": {"exit_code": exit_code}}}}}
    path = tmp_path / f"{label}.json"
    path.write_text(json.dumps(record))
    return path


def test_card_speeds_are_each_cards_steady_rate_over_the_run_it_is_held_against(tmp_path):
    """The first step (warm-up) is left out; the 24 GB card is held against no budget, the 12 GB card against the
    24 GB card's run; a target is written only when both of its runs are there."""
    files = [_host_part(tmp_path, None, [100.0, 640.0, 600.0, 620.0]),
             _host_part(tmp_path, 22.0, [90.0, 610.0, 600.0, 590.0]),
             _host_part(tmp_path, 11.0, [80.0, 530.0, 540.0, 520.0])]
    labels = ["unbounded", "22gib", "11gib"]
    results, targets = offload_recipe.card_speeds([f"{f}:{label}" for f, label in zip(files, labels)])
    assert results["runs"]["unbounded"]["tokens_per_s"] == 620.0
    assert targets["card_24gb_70b_tokens_per_s_16k"]["value"] == round(600.0 / 620.0, 3)
    assert targets["card_24gb_70b_tokens_per_s_16k"]["met"] is True
    assert targets["card_12gb_70b_tokens_per_s_16k"]["value"] == round(530.0 / 600.0, 3)
    assert targets["card_12gb_70b_tokens_per_s_16k"]["met"] is False
    _, only_22 = offload_recipe.card_speeds([f"{f}:{label}" for f, label in zip(files[1:], labels[1:])])
    assert "card_24gb_70b_tokens_per_s_16k" not in only_22 and "card_12gb_70b_tokens_per_s_16k" in only_22
