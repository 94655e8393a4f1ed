"""``benchmarks/multi_gpu/multi_gpu.py --summarize``: prints the merged rows and never overwrites a committed record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "benchmarks" / "multi_gpu" / "results.jsonl"
SCRIPT = ROOT / "benchmarks" / "multi_gpu" / "multi_gpu.py"


def _summarize(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}  # OUT (the device machine's) would be written too
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, str(SCRIPT), "--summarize", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture
def committed_files():
    """Every file the summary could touch, byte for byte; put back afterwards whatever a failing run changed."""
    paths = [*sorted((ROOT / "benchmarks").rglob("*.jsonl")), ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    before = {path: path.read_bytes() for path in paths}
    yield before
    for path, data in before.items():
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)


def _current(name: str) -> dict:
    from benchmarks import records

    return records.current(name)


@pytest.mark.slow
def test_summarize_as_the_readme_writes_it_prints_the_rows_and_changes_no_committed_file(committed_files):
    # Before: it rewrote multi_gpu.json with `device: cpu` (the machine that merged), and make_table.py then put
    # "Measured on cpu GPUs" into the multi-GPU table (now in docs/launching.md).
    res = _summarize()
    changed = [str(p.relative_to(ROOT)) for p, data in committed_files.items() if not p.exists() or p.read_bytes() != data]
    assert not changed, f"--summarize wrote {changed}"
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    committed = _current("multi_gpu")["results"]
    assert [(r["mode"], r["gpus"], r["tokens_per_s_per_gpu"]) for r in rows] == \
        [(r["mode"], r["gpus"], r["tokens_per_s_per_gpu"]) for r in committed]
    assert "| replicated | 4 |" in res.stdout


@pytest.mark.slow
def test_write_records_the_runs_own_provenance_and_refuses_a_committed_record(tmp_path, committed_files):
    from benchmarks import records

    for row in records.rows("multi_gpu"):
        if row["current"] and row["name"].endswith("gpu"):
            (tmp_path / f"{row['name']}.json").write_text(json.dumps(row))
    res = _summarize("--write", "--results-dir", str(tmp_path))
    assert res.returncode == 0, res.stderr[-2000:]
    written = json.loads((tmp_path / "multi_gpu.json").read_text())
    committed = _current("multi_gpu")
    for key in ("device", "cuda", "versions", "git_commit"):
        assert written[key] == committed[key], key  # the H100 runs' own, not this machine's
    assert written["results"] == committed["results"]

    res = _summarize("--write")  # into the multi_gpu table, which git tracks
    assert res.returncode != 0 and "is a committed record" in res.stderr
    assert all(p.read_bytes() == data for p, data in committed_files.items())
