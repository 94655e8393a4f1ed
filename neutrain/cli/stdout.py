"""Standard output's own failures, told apart from the run's.

Why: ``neutrain ... | head -2`` (the reader gone: EPIPE) and ``neutrain ... > /dev/full`` (ENOSPC) ended
a command with "Broken pipe (outputs/run)" or "disk full (outputs/run)": a failed ``print`` raises an
``OSError`` with no file name, and the top level named the run directory, the only path it knew, so
the user looked for a fault in the run's disk. :func:`guard_stdout` puts a writer over file
descriptor 1 that knows it is standard output:

* a reader that has gone (EPIPE) is no error of the command's: what follows goes to ``/dev/null``, as
  ``head`` asked, and the command ends as it would have, quietly (a run in progress is not lost
  because its reader left);
* any other failure (a full disk, an I/O error) raises :class:`StdoutError`, which the top level prints
  as ``stdout: <reason>``, exit 1; later writes are dropped, so the interpreter's own last flush does
  not print a second, raw error.

Only the process's real standard output is guarded (a test's captured stream is left as it is).

Standard error and input are made safe at the same entry (:func:`open_standard_streams`, :func:`guard_stderr`):

* a descriptor the caller closed (``>&-``, ``2>&-``, ``<&-``) is given ``/dev/null`` before anything opens a
  file. Else the first file opened took its number: the run's ``.neutrain.lock`` became descriptor 2, so every
  native library's warning (and the Rust panic capture's replay) was written into the lock, and a child process
  inherited the run's lock as its stderr; Python had set ``sys.stdin`` to None, and ``chat <&-`` was an
  ``AttributeError`` traceback;
* a standard error that cannot be written (``2>&-``, a reader gone, ``2> /dev/full``) drops what is written to it:
  the refusal ``print_error`` could not write raised out of it, and bad input exited 1 (an environment failure)
  instead of 2. Nothing is left to tell the user on; the exit status still says what happened.

Example:
    >>> guard_stdout()  # doctest: +SKIP
    >>> print("x" * 10_000)  # into a closed pipe: nothing raised  # doctest: +SKIP
"""

from __future__ import annotations

import errno
import io
import os
import select
import sys

STDERR_WAIT_S = 10
"""Seconds a non-blocking standard error that is full may take to drain before a write to it is dropped."""


class StdoutError(Exception):
    """Standard output could not be written (not a broken pipe): the message says why."""

    def __init__(self, code: int, reason: str):
        super().__init__(f"stdout: {reason} (the command's output could not be written; its other files are "
                         "unaffected)")
        self.errno = code


def _discard(fd: int) -> None:
    """Point ``fd`` at ``/dev/null``: every later write to it, by anyone, succeeds and goes nowhere."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


class _StdoutFile(io.FileIO):
    """File descriptor 1, whose write failures are standard output's (see the module doc)."""

    def write(self, data) -> int:
        try:
            written = super().write(data)
            while written is None:  # a non-blocking stdout, full for now: wait for its reader, as a blocking one does
                select.select([], [self.fileno()], [])
                written = super().write(data)
            return written
        except BrokenPipeError:
            _discard(self.fileno())
            return len(memoryview(data))
        except OSError as exc:
            _discard(self.fileno())  # reported once, here: the rest of the output is dropped
            raise StdoutError(exc.errno or errno.EIO, exc.strerror or os.strerror(exc.errno or errno.EIO)) from None


_STANDARD = ((0, "stdin", os.O_RDONLY, "r"), (1, "stdout", os.O_WRONLY, "w"), (2, "stderr", os.O_WRONLY, "w"))


def open_standard_streams() -> None:
    """Give each closed standard descriptor ``/dev/null``, and Python a stream over each one it had none for."""
    for fd, name, flags, mode in _STANDARD:
        try:
            os.fstat(fd)
        except OSError:  # closed by the caller: hold its number, so no file of the command's gets it
            null = os.open(os.devnull, flags)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
        if getattr(sys, name) is None:
            stream = open(fd, mode, encoding="utf-8", errors="backslashreplace", closefd=False)
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)


class _StderrFile(io.FileIO):
    """File descriptor 2, which drops what it cannot write: there is nowhere left to report that to."""

    def write(self, data) -> int:
        try:
            written = super().write(data)
            if written is None:  # a non-blocking stderr, full for now: its reader gets a while to catch up
                select.select([], [self.fileno()], [], STDERR_WAIT_S)
                written = super().write(data)
            return len(memoryview(data)) if written is None else written  # still full: this write is dropped
        except OSError:  # closed, its reader gone, a full disk: every later write is dropped too
            _discard(self.fileno())
            return len(memoryview(data))


def guard_stderr() -> bool:
    """Replace the process's own ``sys.stderr`` by a writer over :class:`_StderrFile`, of the same settings;
    False where ``sys.stderr`` is not the process's own (a test capturing it) or is guarded already."""
    current = sys.stderr
    if current is None or current is not sys.__stderr__ or isinstance(getattr(getattr(current, "buffer", None), "raw",
                                                                                     None), _StderrFile):
        return False
    try:
        fd = current.fileno()
    except (OSError, ValueError, AttributeError):
        return False
    try:
        current.flush()
    except OSError:
        pass  # what it held could not be written either: dropped, as every later failed write is
    # Buffered as Python buffers it: the buffer writes again what a partial write left.
    sys.stderr = io.TextIOWrapper(io.BufferedWriter(_StderrFile(fd, "wb", closefd=False)), encoding=current.encoding,
                                  errors=current.errors, line_buffering=True, write_through=True)
    return True


def guard_stdout() -> bool:
    """Replace ``sys.stdout`` by a writer of the same settings over :class:`_StdoutFile`; False where
    ``sys.stdout`` is not the process's own (a test capturing it) or has no file descriptor."""
    current = sys.stdout
    if current is None or current is not sys.__stdout__ or isinstance(getattr(current, "buffer", None),
                                                                      (_Guarded, _StdoutFile)):
        return False
    try:
        fd = current.fileno()
        current.flush()
    except (OSError, ValueError, AttributeError):
        return False
    raw = _StdoutFile(fd, "wb", closefd=False)
    # Layered as Python layered it: unbuffered (python -u, PYTHONUNBUFFERED) stays unbuffered, so a log
    # followed with `tail -f` still sees each line as it is printed.
    unbuffered = isinstance(getattr(current, "buffer", None), io.RawIOBase)
    sys.stdout = io.TextIOWrapper(raw if unbuffered else _Guarded(raw), encoding=current.encoding,
                                  errors=current.errors, line_buffering=current.line_buffering,
                                  write_through=current.write_through)
    return True


class _Guarded(io.BufferedWriter):
    """The buffered layer over :class:`_StdoutFile` (a type of its own, so a second guard sees the first)."""


def flush_stdout() -> None:
    """Flush standard output now (a command's last act), so that a failure is reported as :class:`StdoutError`
    while the top level can still say so, not at interpreter exit."""
    if sys.stdout is not None:
        sys.stdout.flush()
