"""The test counts the README states are the suite's own, within 5%: a figure that drifts fails here.

Why: the README called the quick subset "about 790 tests" when it held 979; a newcomer timing it could not
tell a slow machine from a stale figure.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests import collect_counts

ROOT = Path(__file__).resolve().parents[1]


def stated_counts(text: str) -> dict[str, int]:
    """The README's "the whole suite holds about N tests" and "the quick subset about M".

    Example:
        >>> stated_counts("the whole suite holds about 2,090 tests (...), the quick\\nsubset about 990 (unit")
        {'suite': 2090, 'quick': 990}
    """
    text = " ".join(text.split())
    suite = re.search(r"whole suite holds about ([\d,]+) tests", text)
    quick = re.search(r"quick subset about ([\d,]+)", text)
    assert suite and quick, "the README no longer states the test counts in the form this test reads"
    return {"suite": int(suite.group(1).replace(",", "")), "quick": int(quick.group(1).replace(",", ""))}


def suite_counts() -> dict[str, int]:
    """The suite's counts: this session's own when it collected the whole suite (CI's run), else one collection
    of ``tests`` in a second interpreter (this test run alone, or a subset)."""
    if "counts" in collect_counts.SESSION:
        return collect_counts.SESSION["counts"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tests.collect_counts",
                          "-p", "no:cacheprovider", "tests"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("neutrain-test-counts ")), None)
    assert res.returncode == 0 and line, res.stdout[-2000:] + res.stderr[-2000:]
    return json.loads(line.split(" ", 1)[1])


def test_the_readme_states_how_many_tests_the_suite_and_the_quick_subset_hold():
    counted = suite_counts()
    stated = stated_counts((ROOT / "README.md").read_text())
    for name in ("suite", "quick"):
        assert abs(stated[name] - counted[name]) <= 0.05 * counted[name], \
            f"the README says about {stated[name]:,} tests for the {name}; there are {counted[name]:,}"
