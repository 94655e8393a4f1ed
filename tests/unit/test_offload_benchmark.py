"""benchmarks/offload.py runs each part in its own process: a part that dies costs only its own record."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from benchmarks import offload
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


def test_an_unknown_part_is_refused_in_one_line():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "offload.py"), "--parts", "8b,bogus"],
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "NEUTRAIN_GIT_COMMIT": "0" * 40,
                                                               "NEUTRAIN_GIT_DIRTY": "0", "PYTHONPATH": str(ROOT)},
                          check=False)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "'bogus'" in proc.stderr
