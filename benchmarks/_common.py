"""Shared helpers for benchmarks: timing, memory and the result file.

Every benchmark measures neutrain and its baseline in the same process on the
same card, and writes ``benchmarks/results/<name>.json`` through
:func:`write_result`, which records the device, library versions, git commit and
date beside the settings and numbers. ``benchmarks/make_table.py`` turns those
files into the README's results table.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
from pathlib import Path
from statistics import median
from typing import Any, Callable

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _git_commit() -> str:
    if os.environ.get("NEUTRAIN_GIT_COMMIT"):  # device copies: their .git, if any, may be stale
        return os.environ["NEUTRAIN_GIT_COMMIT"]
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, stderr=subprocess.DEVNULL
        ).decode().strip()
    except Exception:
        return "unknown"


def _git_dirty() -> bool | None:
    """Whether the measured tree had uncommitted changes (device copies pass NEUTRAIN_GIT_DIRTY)."""
    if os.environ.get("NEUTRAIN_GIT_DIRTY") in ("0", "1"):
        return os.environ["NEUTRAIN_GIT_DIRTY"] == "1"
    try:
        out = subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"],
                                      cwd=Path(__file__).resolve().parent, stderr=subprocess.DEVNULL)
        return bool(out.strip())
    except Exception:
        return None


def environment() -> dict[str, Any]:
    """Device name, library versions, git commit and date, for the result file."""
    versions: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "transformers", "accelerate", "peft", "deepspeed"):
        try:
            mod = __import__(name)
            versions[name] = getattr(mod, "__version__", "?")
        except Exception:
            versions[name] = None
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    return {
        "device": device,
        "cuda": torch.version.cuda,
        "versions": versions,
        "git_commit": _git_commit(),
        "git_dirty": _git_dirty(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def cuda_time_ms(fn: Callable[[], Any], warmup: int = 5, iters: int = 30) -> float:
    """Median wall time of ``fn`` in milliseconds, timed with CUDA events after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(median(times))


def peak_memory_gib(fn: Callable[[], Any]) -> float:
    """Peak allocated GiB while running ``fn`` once, after resetting the counter."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def write_result(name: str, settings: dict[str, Any], results: Any, out_dir: str | os.PathLike | None = None) -> Path:
    """Write ``<out_dir or benchmarks/results>/<name>.json`` and return its path.

    When ``$OUT`` is set (the device machine), a copy is also written there so the
    file comes back from a remote run.
    """
    payload = {"name": name, **environment(), "settings": settings, "results": results}
    paths = [Path(out_dir) if out_dir else RESULTS_DIR]
    if os.environ.get("OUT"):
        paths.append(Path(os.environ["OUT"]))
    written = None
    for directory in paths:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{name}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(payload, indent=2, default=str))
        os.replace(tmp, path)
        written = written or path
    return written
