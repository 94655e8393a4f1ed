"""numba's on-disk kernel cache is loaded and written by one process at a time.

Before: the codec's kernels were ``@njit(cache=True)`` alone, and two processes compiling one at once (CI's
parallel tests, a launch's ranks) raced on numba's index file beside the compiled objects. Live processes
here, each with a fresh cache directory (``NUMBA_CACHE_DIR``), so every first call compiles.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import child_env

pytest.importorskip("numba")

REPO = Path(__file__).resolve().parents[2]

# A module of cached kernels, as the codec declares them, and a call that compiles them.
_KERNELS = """
import numpy as np
from neutrain.compat.numba_cache import cached_njit

@cached_njit(inline="always")
def twice(x):
    return 2 * x

@cached_njit()
def total(values):
    s = 0
    for v in values:
        s += twice(v)
    return s
"""
_CALL = "import kernels, numpy as np; print(kernels.total(np.arange(10)), flush=True)"


def _env(tmp_path: Path) -> dict:
    (tmp_path / "kernels.py").write_text(_KERNELS)
    return child_env(tmp_path, NUMBA_CACHE_DIR=str(tmp_path / "numba"))


def _start(tmp_path: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _CALL], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _lock_files(tmp_path: Path) -> list[Path]:
    return list((tmp_path / "numba").rglob(".neutrain-numba.lock"))


@pytest.mark.timeout(180)
def test_two_processes_compiling_the_same_cached_kernel_at_once_both_get_it_and_the_cache_serves_the_next(tmp_path):
    env = _env(tmp_path)
    procs = [_start(tmp_path, env) for _ in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=150)
        assert proc.returncode == 0 and out.split() == ["90"], err[-2000:]
    assert _lock_files(tmp_path)  # the compiles went through the lock in numba's cache directory
    index = list((tmp_path / "numba").rglob("*total*.nbi"))
    assert index, list((tmp_path / "numba").rglob("*"))
    # A third process loads the kernel from that cache (numba says so through its dispatcher's stats).
    probe = "import kernels, numpy as np; kernels.total(np.arange(10)); print(sum(kernels.total.stats.cache_hits.values()))"
    done = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["1"], done.stderr[-2000:] + done.stdout


@pytest.mark.timeout(180)
def test_a_compile_waits_while_another_process_holds_the_cache_lock_and_goes_on_when_it_is_released(tmp_path):
    env = _env(tmp_path)
    first = subprocess.run([sys.executable, "-c", _CALL], env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=150)  # where the lock file lies: the directory numba caches these kernels in
    assert first.returncode == 0, first.stderr[-2000:]
    (lock,) = _lock_files(tmp_path)
    for cached in lock.parent.iterdir():  # a fresh compile again, not a load
        if cached != lock:
            cached.unlink()
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process compiling into that cache now
        waiting = _start(tmp_path, env)
        time.sleep(3 if waiting.poll() is None else 0)
        assert waiting.poll() is None, waiting.communicate()  # blocked on the lock, not compiled beside it
        assert not [p for p in lock.parent.iterdir() if p != lock]  # nothing written while the lock is held
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    out, err = waiting.communicate(timeout=150)
    assert waiting.returncode == 0 and out.split() == ["90"], err[-2000:]


def test_the_lock_is_taken_once_by_the_outermost_compile_of_this_process(tmp_path, monkeypatch):
    from neutrain.compat import numba_cache

    calls = []
    real = fcntl.flock
    monkeypatch.setattr(numba_cache.fcntl, "flock", lambda fd, op: (calls.append(op), real(fd, op))[1])
    with numba_cache.cache_lock(str(tmp_path)):
        with numba_cache.cache_lock(str(tmp_path)):  # a kernel typing another: no second flock (it would deadlock)
            pass
    assert calls == [fcntl.LOCK_EX | fcntl.LOCK_NB, fcntl.LOCK_UN]
    assert (tmp_path / numba_cache.LOCK_NAME).is_file()


def test_every_kernel_the_codec_caches_on_disk_compiles_under_the_lock():
    from numba.core.caching import NullCache
    from numba.core.registry import CPUDispatcher

    from neutrain.compress import codec_cpu

    cached = {name: k for name, k in vars(codec_cpu).items()
              if isinstance(k, CPUDispatcher) and not isinstance(k._cache, NullCache)}
    assert cached and {name: "compile" in vars(k) for name, k in cached.items()} == dict.fromkeys(cached, True)
