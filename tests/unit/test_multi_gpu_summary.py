"""``benchmarks/multi_gpu.py --summarize``: prints the merged rows and never overwrites a committed record."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
SCRIPT = ROOT / "benchmarks" / "multi_gpu.py"


def _summarize(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}  # OUT (the device machine's) would be written too
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, str(SCRIPT), "--summarize", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture
def committed_files():
    """Every file the summary could touch, byte for byte; put back afterwards whatever a failing run changed."""
    paths = [*sorted(RESULTS.glob("*.json")), ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    before = {path: path.read_bytes() for path in paths}
    yield before
    for path, data in before.items():
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)
    for path in RESULTS.glob("*.json"):
        if path not in before:  # written by a failing run
            path.unlink()


@pytest.mark.slow
def test_summarize_as_the_readme_writes_it_prints_the_rows_and_changes_no_committed_file(committed_files):
    # Before: it rewrote multi_gpu.json with `device: cpu` (the machine that merged), and make_table.py then put
    # "Measured on cpu GPUs" into the multi-GPU table (now in docs/launching.md).
    res = _summarize()
    changed = [str(p.relative_to(ROOT)) for p, data in committed_files.items() if not p.exists() or p.read_bytes() != data]
    new = [str(p.relative_to(ROOT)) for p in RESULTS.glob("*.json") if p not in committed_files]
    assert not changed and not new, f"--summarize wrote {changed + new}"
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    committed = json.loads((RESULTS / "multi_gpu.json").read_text())["results"]
    assert [(r["mode"], r["gpus"], r["tokens_per_s_per_gpu"]) for r in rows] == \
        [(r["mode"], r["gpus"], r["tokens_per_s_per_gpu"]) for r in committed]
    assert "| replicated | 4 |" in res.stdout


@pytest.mark.slow
def test_write_records_the_runs_own_provenance_and_refuses_a_committed_record(tmp_path, committed_files):
    for path in RESULTS.glob("multi_gpu_*gpu.json"):
        shutil.copy(path, tmp_path / path.name)
    res = _summarize("--write", "--results-dir", str(tmp_path))
    assert res.returncode == 0, res.stderr[-2000:]
    written = json.loads((tmp_path / "multi_gpu.json").read_text())
    committed = json.loads((RESULTS / "multi_gpu.json").read_text())
    for key in ("device", "cuda", "versions", "git_commit"):
        assert written[key] == committed[key], key  # the H100 runs' own, not this machine's
    assert written["results"] == committed["results"]

    res = _summarize("--write")  # into benchmarks/results, where git tracks multi_gpu.json
    assert res.returncode != 0 and "is a committed record" in res.stderr
    assert all(p.read_bytes() == data for p, data in committed_files.items())
