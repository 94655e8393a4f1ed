"""Ctrl-C while ``neutrain`` is still starting: one line and exit 130, never an import's traceback.

Why: a Ctrl-C in the first half second of any command (``neutrain train R``, ``python -m neutrain ...``,
``accelerate launch -m neutrain``'s processes) landed in an import of the package or of the command's module,
before :func:`neutrain.cli.main.main` could catch it, and printed a 20-line ``KeyboardInterrupt`` traceback
through pydantic, yaml or the standard library, exit 1 or -2. The package's first act, when the process was
started as the ``neutrain`` command, is to answer SIGINT itself until ``main`` takes over
(:func:`end_of_start`), which answers it the same way. A program that only imports neutrain keeps its own
Ctrl-C.

Only the standard library is imported here: this runs before anything else of neutrain.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

INTERRUPTED = b"neutrain: interrupted\n"


def started_as_command(orig_argv: list[str], argv: list[str]) -> bool:
    """Whether this process is the ``neutrain`` command: ``python [options] -m neutrain ...`` or the console script.

    Example:
        >>> started_as_command(["python", "-u", "-m", "neutrain", "train"], ["-m"])
        True
        >>> started_as_command(["python", "-m", "pytest"], ["/env/bin/pytest"])
        False
        >>> started_as_command(["/venv/bin/python", "/venv/bin/neutrain", "train"], ["/venv/bin/neutrain", "train"])
        True
    """
    if argv[:1] == ["-m"]:  # Python sets it so while `-m`'s module is looked up, i.e. imported
        first = orig_argv.index("-m") if "-m" in orig_argv else len(orig_argv)
        return orig_argv[first + 1:first + 2] == ["neutrain"]
    return bool(argv) and os.path.basename(argv[0]) == "neutrain"


def _interrupted(signum, frame) -> None:
    try:
        os.write(2, INTERRUPTED)
    except OSError:
        pass  # no stderr to say it on; the status says it
    os._exit(128 + signal.SIGINT)


def guard_start() -> bool:
    """Answer SIGINT with one line and exit 130 while the package starts, when this process is the command and
    Ctrl-C still has Python's default handler; True when it did."""
    if (threading.current_thread() is not threading.main_thread()
            or not started_as_command(getattr(sys, "orig_argv", []), sys.argv)
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        return False
    signal.signal(signal.SIGINT, _interrupted)
    return True


def end_of_start() -> None:
    """Give SIGINT back to Python (a ``KeyboardInterrupt``, which ``main`` turns into the same line), where
    :func:`guard_start` had taken it."""
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is _interrupted):
        signal.signal(signal.SIGINT, signal.default_int_handler)
