"""The results tables in docs/ are generated from the current rows of benchmarks/<topic>/results.jsonl and must be current."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_results_tables_match_result_files():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_table.py"), "--check"], capture_output=True, text=True)
    assert res.returncode == 0, f"results tables are stale: run `python benchmarks/make_table.py`\n{res.stderr}"
