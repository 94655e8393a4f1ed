"""A panic inside a Rust extension (``tokenizers``), caught as the one line it should be.

Why: a tokenizer's normalizer or pre-tokenizer regex runs in Oniguruma, which gives up on a pattern that
backtracks without end (``(a+)+$`` on a long row) after its retry limit: the bound is there, but the
``tokenizers`` binding turns that error into a Rust panic. The panic hook prints its message (and, under
``RUST_BACKTRACE=1``, a hundred-line backtrace) straight to file descriptor 2, and pyo3 raises
``PanicException``, a ``BaseException`` that no ``except Exception`` catches: the run ended in both.
:func:`native_panics` runs a block with descriptor 2 captured, so that a panic's own output is dropped
and the panic becomes the caller's error; anything else written to stderr in the block is written back
when it ends.

Example:
    >>> with native_panics(lambda message: ValueError(f"row 3: {message}")):  # doctest: +SKIP
    ...     tokenizer("a" * 50 + "b")
    Traceback (most recent call last):
    ValueError: row 3: Onig: Regex search error: retry-limit-in-match over
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
from typing import Callable

_CAPTURE: list[int] = []  # one scratch file per process (its descriptor; the file is unlinked), reused by every block
_LOCK = threading.Lock()


def is_panic(exc: BaseException) -> bool:
    """Whether ``exc`` is pyo3's ``PanicException`` (its module is ``pyo3_runtime``, made at import of an extension)."""
    return type(exc).__name__ == "PanicException"


@contextlib.contextmanager
def native_panics(describe: Callable[[str], BaseException]):
    """Run the block with stderr (descriptor 2) captured; a Rust panic raised in it becomes ``describe(message)``.

    A block entered from another thread while one runs is run without capture (the descriptor is the
    process's), so a panic there is still turned into ``describe``'s error, only its printed lines remain.
    """
    if not _LOCK.acquire(blocking=False):
        try:
            yield
        except BaseException as exc:
            if is_panic(exc):
                raise describe(" ".join(str(exc).split())) from None
            raise
        return
    try:
        if not _CAPTURE:
            fd, name = tempfile.mkstemp(prefix="neutrain-stderr-")
            os.unlink(name)
            _CAPTURE.append(fd)
        scratch = _CAPTURE[0]
        for stream in (sys.stderr, sys.__stderr__):
            if stream is not None:
                with contextlib.suppress(Exception):
                    stream.flush()
        saved = os.dup(2)
        os.dup2(scratch, 2)
        panicked = False
        try:
            yield
        except BaseException as exc:
            panicked = is_panic(exc)
            if panicked:
                raise describe(" ".join(str(exc).split())) from None
            raise
        finally:
            for stream in (sys.stderr, sys.__stderr__):
                if stream is not None:
                    with contextlib.suppress(Exception):
                        stream.flush()
            os.dup2(saved, 2)
            os.close(saved)
            written = os.lseek(scratch, 0, os.SEEK_CUR)
            if written:
                os.lseek(scratch, 0, os.SEEK_SET)
                captured = os.read(scratch, written)
                os.lseek(scratch, 0, os.SEEK_SET)
                os.ftruncate(scratch, 0)
                while captured and not panicked:
                    captured = captured[os.write(2, captured):]
    finally:
        _LOCK.release()
