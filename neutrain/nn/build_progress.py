"""Progress of a build that takes more than a few seconds: a labelled bar on a terminal, lines in a log.

Why: ``neutrain generate`` of a GGUF file and the build of a large model printed nothing for tens of
seconds (minutes on a busy machine); a user could not tell whether anything was happening. A build
shorter than :data:`QUIET_FOR` seconds still prints nothing. On a terminal a tqdm bar appears after
that; written to a file or a pipe (no bar redraws in a log) one line appears then, one every
:data:`EVERY` seconds after, each with the count, the elapsed time and, when the total is known, the
time left, and a last line says how long the whole build took. ``DISABLE_TQDM=1`` silences both.

Example:
    >>> import io
    >>> log = io.StringIO()
    >>> ticks = iter(range(0, 100, 4))  # a clock: 4 s per item
    >>> list(build_progress(range(3), "loading weights", total=3, stream=log, clock=lambda: next(ticks), environ={}))
    [0, 1, 2]
    >>> print(log.getvalue(), end="")
    loading weights: 2/3 tensors, 8 s elapsed, about 4 s left
    loading weights: 3 tensors in 16 s
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import IO, Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")

QUIET_FOR = 5.0
"""Seconds a build runs before anything is shown."""
EVERY = 30.0
"""Seconds between two lines in a log."""


def _is_terminal(stream: IO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def build_progress(items: Iterable[T], label: str, total: int | None = None, enabled: bool = True, *,
                   unit: str = "tensors", stream: IO | None = None,
                   clock: Callable[[], float] = time.monotonic, environ: Mapping[str, str] = os.environ) -> Iterator[T]:
    """``items``, passed through, with progress on ``stream`` (stderr) once they take more than :data:`QUIET_FOR` s."""
    stream = sys.stderr if stream is None else stream
    if not enabled or environ.get("DISABLE_TQDM", "0") == "1":
        yield from items
        return
    if _is_terminal(stream) and environ.get("TQDM_DISABLE", "").lower() not in {"1", "true"}:
        from tqdm.auto import tqdm

        yield from tqdm(items, desc=label, total=total, unit=unit.rstrip("s"), file=stream, delay=QUIET_FOR)
        return
    start = clock()
    shown_at, done = None, 0
    for item in items:
        yield item
        done += 1
        now = clock()
        if now - start >= QUIET_FOR and (shown_at is None or now - shown_at >= EVERY):
            shown_at = now
            left = f", about {(now - start) / done * (total - done):.0f} s left" if total and done < total else ""
            print(f"{label}: {done}/{total or '?'} {unit}, {now - start:.0f} s elapsed{left}", file=stream, flush=True)
    if shown_at is not None:
        print(f"{label}: {done} {unit} in {clock() - start:.0f} s", file=stream, flush=True)
