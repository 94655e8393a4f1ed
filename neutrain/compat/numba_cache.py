"""numba's on-disk kernel cache (``cache=True``), loaded and written by one process at a time.

Why: numba keeps one index file per cached function beside its compiled objects and rewrites it after
each compile. Two processes compiling the same kernel at once (CI's parallel tests, the ranks of a
launch, a training run beside ``neutrain eval``) each read the index, compile, and write it back: one
overwrote the other's entry, or read an index the other was halfway through writing. Here every
compile of a cached kernel, which is also where numba reads its cache, holds an exclusive
``fcntl.flock`` on :data:`LOCK_NAME` in that kernel's cache directory; a process that finds the kernel
compiled in memory takes no lock. Where numba is absent (or flock is, off POSIX) this is a no-op.

Example (a kernel is declared in a module file with ``@cached_njit()`` in place of ``@numba.njit(cache=True)``;
numba caches only functions it can locate in a file, so the lock is shown alone here):
    >>> import tempfile
    >>> with cache_lock(tempfile.mkdtemp()):  # what each compile of a cached kernel holds
    ...     pass
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile

try:  # optional: the compiled CPU codec needs it, nothing else does
    import numba
    from numba.core.compiler_lock import global_compiler_lock
except ImportError:  # pragma: no cover - exercised where numba is absent
    numba = None

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: numba's own cache handling, unserialised
    fcntl = None

logger = logging.getLogger("neutrain")

LOCK_NAME = ".neutrain-numba.lock"
_depth = [0]  # nested compiles (a kernel typing another) of this process: the lock is taken once, by the outermost


def cache_directory(dispatcher) -> str:
    """Where numba keeps ``dispatcher``'s cached kernels; a per-user temporary folder where it cannot tell."""
    path = getattr(getattr(dispatcher, "_cache", None), "_cache_path", None)
    if isinstance(path, str):
        return path
    return os.environ.get("NUMBA_CACHE_DIR") or os.path.join(tempfile.gettempdir(), f"neutrain-numba-{os.getuid()}")


@contextlib.contextmanager
def cache_lock(directory: str):
    """Hold the exclusive lock on numba's cache in ``directory`` (blocking; reentrant within this process).

    Inside numba's own compiler lock: a thread of this process that compiles another kernel meanwhile
    waits there, never between the two locks.
    """
    if fcntl is None:
        yield
        return
    with contextlib.ExitStack() as stack:
        if numba is not None:
            stack.enter_context(global_compiler_lock)
        if _depth[0] == 0:
            try:
                os.makedirs(directory, exist_ok=True)
                fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o666)
            except OSError:  # a cache numba cannot write either: it compiles without caching, nothing to guard
                fd = None
            if fd is not None:
                stack.callback(os.close, fd)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    logger.info("waiting for another process compiling numba kernels into %s", directory)
                    fcntl.flock(fd, fcntl.LOCK_EX)
                stack.callback(fcntl.flock, fd, fcntl.LOCK_UN)
        _depth[0] += 1
        stack.callback(_leave)
        yield


def _leave() -> None:
    _depth[0] -= 1


def serialize_compiles(dispatcher):
    """Make each compile of ``dispatcher`` (a numba ``@njit(cache=True)`` function) hold :func:`cache_lock`.

    numba's dispatcher calls its ``compile`` method, looked up on the instance, only when no kernel compiled
    in this process fits the arguments: the lock costs nothing once a kernel is in memory.
    """
    original = dispatcher.compile
    directory = cache_directory(dispatcher)

    def compile(sig):
        with cache_lock(directory):
            return original(sig)

    dispatcher.compile = compile
    return dispatcher


def cached_njit(**options):
    """``numba.njit(cache=True, **options)``, its compiles serialised across processes (:func:`serialize_compiles`);
    the function unchanged where numba is absent."""
    if numba is None:  # pragma: no cover - exercised where numba is absent
        return lambda function: function

    def decorate(function):
        return serialize_compiles(numba.njit(cache=True, **options)(function))

    return decorate
