"""Shared helpers for benchmarks: timing, memory and the result record.

Every benchmark measures neutrain and its baseline in the same process on the
same card, and appends its record to its topic's table, ``benchmarks/<topic>/results.jsonl``
(``benchmarks/records.py``), through :func:`write_result`, which records the device, library
versions, git commit, whether the tree was dirty, the date and the targets beside the settings
and numbers. ``benchmarks/make_table.py`` turns the current rows into the results tables of
``docs/`` (``docs/results.md`` and the tables on the topic pages).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import subprocess
from pathlib import Path
from statistics import median
from typing import Any, Callable

import torch

# One id a process: a benchmark that writes its record as it goes replaces its own row (benchmarks/records.py).
RUN_ID = f"{_dt.datetime.now(_dt.timezone.utc):%Y%m%dT%H%M%S}-{os.getpid()}"

try:
    from benchmarks import records
except ImportError:  # run as a script with benchmarks/ itself on sys.path
    import records  # type: ignore[no-redef]


class ProvenanceError(RuntimeError):
    """The commit (or the dirty flag) of the code being measured cannot be established."""


_SHA = re.compile(r"[0-9a-f]{7,40}")
_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")


def _git(*args: str) -> str:
    return subprocess.check_output(["git", *args], cwd=Path(__file__).resolve().parent,
                                   stderr=subprocess.DEVNULL).decode()


def git_provenance() -> tuple[str, bool]:
    """``(commit, dirty)`` of the code being measured; raises :class:`ProvenanceError` if unknown.

    ``NEUTRAIN_GIT_COMMIT`` wins over ``git``: a device copy's ``.git``, if it has one,
    may be stale (inference.json once recorded such a commit and had to be corrected
    by hand: its archived row in decode/results.jsonl says so). When the commit comes from the
    environment, so must ``NEUTRAIN_GIT_DIRTY`` (``0``/``1``), for the same reason.
    Call it before measuring, so a run that could not record its commit fails at once.
    """
    env_commit, env_dirty = os.environ.get("NEUTRAIN_GIT_COMMIT", "").strip(), os.environ.get("NEUTRAIN_GIT_DIRTY")
    if env_dirty is not None and env_dirty.strip().lower() not in _TRUE + _FALSE:
        raise ProvenanceError(f"NEUTRAIN_GIT_DIRTY={env_dirty!r}: expected 0 or 1")
    if env_dirty is not None and not env_commit:
        # Set by a device script whose commit variable came out empty (``$(cat missing-file)``): the copy's
        # .git would answer with a stale commit and the dirty flag would vouch for it (it happened once).
        raise ProvenanceError("NEUTRAIN_GIT_DIRTY is set but NEUTRAIN_GIT_COMMIT is empty: set it to the measured "
                              "tree's $(git rev-parse HEAD)")
    if env_commit:
        commit = env_commit
        if env_dirty is None:
            raise ProvenanceError("NEUTRAIN_GIT_COMMIT is set but NEUTRAIN_GIT_DIRTY is not: set it to 1 if the "
                                  "measured tree had uncommitted changes, else 0 (git status --porcelain)")
    else:
        try:
            commit = _git("rev-parse", "HEAD").strip()
        except (OSError, subprocess.CalledProcessError):
            raise ProvenanceError("no git commit for the measured code: set NEUTRAIN_GIT_COMMIT=$(git rev-parse HEAD) "
                                  "and NEUTRAIN_GIT_DIRTY (0/1) when the copy has no .git") from None
    if not _SHA.fullmatch(commit.lower()):
        raise ProvenanceError(f"git commit {commit!r} is not a commit hash: set NEUTRAIN_GIT_COMMIT=$(git rev-parse HEAD)")
    if env_dirty is not None:
        return commit, env_dirty.strip().lower() in _TRUE
    return commit, bool(_git("status", "--porcelain").strip())


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
    """Device name, library versions, git commit, dirty flag and date, for the result file."""
    versions: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "transformers", "accelerate", "peft", "deepspeed"):
        try:
            mod = __import__(name)
            versions[name] = getattr(mod, "__version__", "?")
        except Exception:
            versions[name] = None
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    commit, dirty = git_provenance()
    return {
        "device": device,
        "cuda": torch.version.cuda,
        "versions": versions,
        "git_commit": commit,
        "git_dirty": dirty,
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


def check_targets(targets: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Validate a ``targets`` object: ``{name: {"value": measured, "goal": wanted, ...}}``.

    ``goal`` may be a number or a short text such as ``"<= 10.9"``; extra keys (``unit``,
    ``met``, ``derived_from``) are kept. An empty object is allowed; say why in ``targets_note``.
    """
    if not isinstance(targets, dict):
        raise TypeError(f"targets must be a dict of {{name: {{'value': x, 'goal': g}}}}, got {type(targets).__name__}")
    for name, entry in targets.items():
        if not isinstance(entry, dict) or not {"value", "goal"} <= entry.keys():
            raise ValueError(f"targets[{name!r}] must hold 'value' and 'goal', got {entry!r}")
    return targets


def write_result(name: str, settings: dict[str, Any], results: Any, out_dir: str | os.PathLike | None = None,
                 *, targets: dict[str, dict[str, Any]] | None = None, targets_note: str | None = None,
                 measured_on: dict[str, Any] | None = None) -> Path:
    """Append the record of ``name`` to its topic's table as the current row and return the table's path.

    The record holds the device, versions, ``git_commit`` and ``git_dirty`` (see
    :func:`git_provenance`, which raises rather than write "unknown"), the settings,
    the results and ``targets``: each goal the issue or the docs set for this
    benchmark beside the value measured, ``{name: {"value": x, "goal": g}}``.

    With ``out_dir`` (a scratch directory, a test's tmp_path) the record is written to
    ``<out_dir>/<name>.json`` instead and that path returned. When ``$OUT`` is set (the device
    machine), ``$OUT/<name>.json`` is written too: only ``$OUT`` comes back from a remote run, and
    ``python benchmarks/records.py add`` folds such files into the tables.
    ``measured_on`` (``device``, ``cuda``, ``versions``, ``date``) replaces this machine's when the
    record is assembled elsewhere from parts measured on the device.

    Example:
        >>> write_result("codec", {"shape": [4096, 14336]}, {"bits_per_weight": 10.69},
        ...              targets={"bits_per_weight": {"value": 10.69, "goal": "<= 10.9"}})  # doctest: +SKIP
    """
    targets = check_targets({} if targets is None else targets)
    env = environment()
    if measured_on:
        env.update({k: v for k, v in measured_on.items() if k in ("device", "cuda", "versions", "date")},
                   assembled_on=env["device"])
    payload = {"name": name, **env, "run_id": RUN_ID, "targets": targets}
    if targets_note or not targets:
        payload["targets_note"] = targets_note or "this benchmark records no goal"
    payload.update({"settings": settings, "results": json.loads(json.dumps(results, default=str))})
    files = [Path(out_dir)] if out_dir else []
    if os.environ.get("OUT"):
        files.append(Path(os.environ["OUT"]))
    written = None if out_dir else records.append(payload)
    for directory in files:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{name}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(payload, indent=2, default=str))
        os.replace(tmp, path)
        written = written or path
    return written


def read_record(name: str, out_dir: str | os.PathLike | None = None) -> dict[str, Any] | None:
    """The record of ``name``: ``<out_dir>/<name>.json`` when ``out_dir`` is given, else the current row of its
    topic's table; None when there is none (a benchmark that merges its parts into the previous record)."""
    if out_dir:
        path = Path(out_dir) / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None
    return records.current(name)


def read_run(run_dir: str | os.PathLike) -> dict[str, Any]:
    """What a ``neutrain train`` run directory says of itself: ``records`` (``metrics.jsonl``, read by
    :func:`neutrain.trainer.callbacks.read_metrics`: a torn line skipped, a resumed step's record the
    last one), its ``steps`` (records with a loss), its ``phases`` (phase memory records) and ``summary``."""
    from neutrain.trainer.callbacks import read_metrics

    run = Path(run_dir)
    records = read_metrics(run / "metrics.jsonl")
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    return {"records": records, "steps": [r for r in records if "loss" in r],
            "phases": [r for r in records if "phase" in r], "summary": summary}
