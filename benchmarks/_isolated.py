"""Run each part of a benchmark in its own process, so that a CUDA fault in one keeps the others' numbers.

A device-side fault (``an illegal memory access was encountered``) poisons the CUDA context: every
later call of the process fails, and the process often aborts in a destructor (``terminate called
after throwing an instance of 'c10::AcceleratorError'``), so nothing after it is written. The Llama-3-8B
offload run lost its in-GPU numbers that way. :func:`run_part` starts the part in a child process that
writes its record to a file before it exits (:func:`child`); when the child dies, the part's record is
one line saying how (:func:`failure_line`), and the parent goes on to the next part.

Example:
    >>> import sys
    >>> run_part("ok", [sys.executable, "-c", "import sys, json; json.dump({'x': 1}, open(sys.argv[1], 'w'))"])
    {'x': 1}
    >>> run_part("bad", [sys.executable, "-c", "raise SystemExit('CUDA error: boom')"], echo=False)["failed"]
    'CUDA error: boom (exit 1)'
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

_ERROR = re.compile(r"(Error|error|Exception|terminate called|Killed|Aborted|Traceback)")


def failure_line(stderr: str, returncode: int) -> str:
    """One line for a part that died: the most specific error line of its stderr, and how it ended.

    Example:
        >>> failure_line("x\\ntorch.AcceleratorError: CUDA error: an illegal memory access was encountered\\n"
        ...              "terminate called after throwing an instance of 'c10::AcceleratorError'\\n", -6)
        'torch.AcceleratorError: CUDA error: an illegal memory access was encountered (exit -6)'
    """
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b.*:", line)]
    other = [line for line in lines if _ERROR.search(line) and not line.startswith("Traceback")]
    line = raised[-1] if raised else other[-1] if other else lines[-1] if lines else "no output"
    how = f"signal {-returncode}" if returncode < 0 and returncode != -6 else f"exit {returncode}"
    return f"{line[:400]} ({how})"


def run_part(part: str, command: list[str], timeout: float | None = None, echo: bool = True) -> dict:
    """Run ``command`` + ``[record path]`` in a child process; return the record it wrote, or
    ``{"failed": <one line>, "returncode": rc}`` if it wrote none (a crash, an abort, a timeout).

    The child's stdout goes straight through; its stderr is echoed after it ends (``echo``).
    """
    fd, record = tempfile.mkstemp(prefix=f"bench-{part}-", suffix=".json")
    os.close(fd)
    os.unlink(record)  # the child creates it only when it has a result
    try:
        try:
            proc = subprocess.run([*command, record], stdout=None, stderr=subprocess.PIPE, text=True,
                                  timeout=timeout, check=False)
            stderr, returncode = proc.stderr or "", proc.returncode
        except subprocess.TimeoutExpired as exc:
            stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
            stderr += f"\nTimeoutError: part {part} ran past {timeout} s"
            returncode = 124
        if echo and stderr:
            sys.stderr.write(stderr if stderr.endswith("\n") else stderr + "\n")
            sys.stderr.flush()
        path = Path(record)
        if path.exists():
            return json.loads(path.read_text())
        return {"failed": failure_line(stderr, returncode), "returncode": returncode}
    finally:
        Path(record).unlink(missing_ok=True)


def child(run: Callable[[], dict], record: str) -> None:
    """In the child process: run the part, write its record (or ``{"failed": ...}``) atomically, and
    leave at once (``os._exit``): after a CUDA fault the interpreter's own exit can abort before it
    would have written anything."""
    try:
        result, code = run(), 0
    except Exception as exc:  # noqa: BLE001 - any failure of the part becomes its one-line record
        traceback.print_exc()
        first = (str(exc).splitlines() or [""])[0]
        result, code = {"failed": f"{type(exc).__name__}: {first}"[:400]}, 1
    tmp = f"{record}.tmp"
    with open(tmp, "w") as fh:
        json.dump(result, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, record)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
