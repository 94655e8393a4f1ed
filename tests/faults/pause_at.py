"""Run ``neutrain`` and hold it at the first call of a chosen function until told to go on.

    python -m tests.faults.pause_at <module>:<attribute path> <gate dir> <neutrain args...>

e.g. ``neutrain.distill.trainer:DistillationTrainer.train``. When the function is first called the
process writes ``<gate dir>/paused`` (its pid) and waits for ``<gate dir>/go``; then the call goes
on as usual. A pause the run never reaches exits 3, and one nobody releases within 5 minutes
exits 4, so a test cannot pass by accident. The process's own exit code is kept otherwise.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import time
from pathlib import Path


def hold(gate: Path) -> None:
    """Write ``gate/paused`` and wait for ``gate/go`` (exit 4 after 5 minutes)."""
    (gate / "paused").write_text(str(os.getpid()))
    deadline = time.monotonic() + 300
    while not (gate / "go").exists():
        if time.monotonic() > deadline:
            os._exit(4)
        time.sleep(0.05)


def wait_until_paused(proc, gate: Path, what: str, timeout: float = 240) -> None:
    """Wait for ``proc`` (a ``subprocess.Popen`` run of this module) to write ``gate/paused``; fail the test when it
    exits first or ``timeout`` seconds pass, naming ``what`` it never reached."""
    deadline = time.monotonic() + timeout
    while not (gate / "paused").exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"the run never reached {what}"
        time.sleep(0.1)


def signal_and_collect(proc, signum: int, timeout: float = 240) -> tuple[str, str]:
    """Send ``signum`` to ``proc`` (a ``subprocess.Popen`` with text pipes), wait for it and return its
    ``(stdout, stderr)``; a process still running after ``timeout`` seconds is killed (the test then fails)."""
    try:
        proc.send_signal(signum)
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()


def attribute_at(target: str) -> tuple[object, str]:
    """``(owner, name)`` of ``<module>:<attribute path>``: ``setattr(owner, name, ...)`` replaces it."""
    module_name, path = target.split(":")
    *owners, name = path.split(".")
    owner = importlib.import_module(module_name)
    for attribute in owners:
        owner = getattr(owner, attribute)
    return owner, name


def main() -> int:
    target, gate, args = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    owner, name = attribute_at(target)
    original = getattr(owner, name)
    reached = []

    @functools.wraps(original)
    def paused(*call_args, **kwargs):
        if not reached:
            reached.append(True)
            hold(gate)
        return original(*call_args, **kwargs)

    setattr(owner, name, paused)
    return run_reaching(args, reached, target)


def run_reaching(args: list[str], reached: list, where: str) -> int:
    """``neutrain args``; exit 3 when the pause at ``where`` was never reached (``reached`` stays empty)."""
    from neutrain.cli import main as neutrain_main

    code = neutrain_main(args)
    if not reached:
        print(f"the pause at {where} was never reached", file=sys.stderr)
        return 3
    return code


if __name__ == "__main__":
    raise SystemExit(main())
