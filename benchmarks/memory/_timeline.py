"""A device timeline from a torch.profiler Chrome trace: per-kernel count and device time per step, kernel groups,
device busy and idle time, and the gaps between kernels.

Why one module: a CUDA graph hides a step's phases from events and host timers, and CUPTI still traces the
kernels inside a replay, so the kernel table is how both the engine's decode profile
(``benchmarks/decode/decode_profile.py``) and the KV benchmark's graphed rows (``benchmarks/kv/_kv_graph.py``) see
where a replayed step spends its time.

* :func:`kernel_intervals`: ``(name, start_us, duration_us)`` of every GPU kernel in a trace;
* :func:`timeline_table`: the table of ``steps`` profiled steps, every figure per step;
* :func:`profile_kernels`: run a callable under the profiler and return its kernel intervals (the trace written
  to a temporary file, optionally kept gzipped).

Groups are matched in order, the first pattern that finds the kernel's name wins: a caller's own groups (say
ShadowKV's fused attention and its gather) go ahead of :data:`GROUPS`, which would otherwise file them under a
generic group or ``other``.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

Groups = Sequence[tuple[str, re.Pattern]]
"""Named kernel-name patterns: ``(group, compiled pattern)``, matched in order."""

GROUPS: Groups = (
    ("product", re.compile(r"gemv|gemm|nvjet|xmma|cutlass|splitk|zgemv|_sum_partials", re.IGNORECASE)),
    ("attention", re.compile(r"attention|fmha|flash|cudnn|sdpa|softmax", re.IGNORECASE)),
    ("norm_and_pointwise", re.compile(r"elementwise|vectorized|reduce|norm|rsqrt|pow|mean|mul|add|copy|cat|index|"
                                      r"triton_|unrolled", re.IGNORECASE)),
)
"""The default kernel groups: GEMV/GEMM (cuBLAS, Triton, neutrain's zgemv), attention, norms and pointwise."""


def group_of(name: str, groups: Groups = ()) -> str:
    """The first of ``groups``, then of :data:`GROUPS`, whose pattern finds ``name``; ``other`` if none does."""
    return next((group for group, pattern in (*groups, *GROUPS) if pattern.search(name)), "other")


def kernel_intervals(trace_path: Path | str) -> list[tuple[str, float, float]]:
    """``(name, start_us, duration_us)`` of every GPU kernel in a Chrome trace, in start order (memory copies,
    host ops and markers left out)."""
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [(e["name"], float(e["ts"]), float(e["dur"])) for e in events
               if e.get("ph") == "X" and e.get("cat") == "kernel"]
    return sorted(kernels, key=lambda k: k[1])


def busy_and_gaps(intervals: Sequence[tuple[float, float]]) -> tuple[float, float, list[float]]:
    """``(span, busy, gaps)`` of ``(start, end)`` intervals sorted by start: the first start to the last end, the
    union of the intervals (overlaps on several streams count once), and the idle stretches between them, in order.

    Example:
        >>> busy_and_gaps([(0, 4), (2, 6), (9, 10)])
        (10, 7, [3])
    """
    busy, first, end, gaps = 0, intervals[0][0], intervals[0][0], []
    for start, stop in intervals:
        if start > end:
            gaps.append(start - end)
        busy += max(0, stop - max(start, end))
        end = max(end, stop)
    return end - first, busy, gaps


def _rounded(row: dict) -> dict:
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}


def timeline_table(kernels: list[tuple[str, float, float]], steps: int, weight_bytes: float | None = None,
                   groups: Groups = (), top: int = 25) -> dict:
    """The kernel table and gap statistics of ``steps`` profiled steps, each figure per step.

    ``busy``: the union of the kernel intervals (kernels overlapping on several streams count once); ``idle``:
    the span from the first kernel's start to the last one's end less ``busy``; ``gaps``: the idle stretches
    between kernels. ``weight_bytes`` (the bytes one step's products must read): given, the products' achieved
    bandwidth over their summed device time is added as ``product_bytes_per_s``. ``top``: the kernels kept in
    the table, the most device time first.
    """
    if not kernels:
        return {"error": "the trace holds no kernel events"}
    by_name: dict[str, list[float]] = {}
    for name, _, dur in kernels:
        by_name.setdefault(name, []).append(dur)
    table = sorted(({"kernel": name[:140], "group": group_of(name, groups), "per_step": len(d) / steps,
                     "us_per_step": sum(d) / steps, "median_us": statistics.median(d)}
                    for name, d in by_name.items()), key=lambda r: -r["us_per_step"])
    span, busy, gaps = busy_and_gaps([(start, start + dur) for _, start, dur in kernels])
    group_us: dict[str, float] = {}
    for row in table:
        group_us[row["group"]] = group_us.get(row["group"], 0.0) + row["us_per_step"]
    out = {
        "kernels_per_step": len(kernels) / steps,
        "span_us_per_step": span / steps,
        "busy_us_per_step": busy / steps,
        "idle_us_per_step": (span - busy) / steps,
        "gaps": {"count_per_step": len(gaps) / steps, "median_us": statistics.median(gaps) if gaps else 0.0,
                 "p90_us": sorted(gaps)[int(0.9 * (len(gaps) - 1))] if gaps else 0.0,
                 "over_10us_per_step": sum(1 for g in gaps if g > 10) / steps},
        "group_us_per_step": {k: round(v, 1) for k, v in sorted(group_us.items(), key=lambda kv: -kv[1])},
        "top": [_rounded(row) for row in table[:top]],
    }
    if weight_bytes is not None:
        product_us = group_us.get("product", 0.0)
        out["product_bytes_per_s"] = weight_bytes / (product_us / 1e6) if product_us else None
    return out


def profile_kernels(run: Callable[[], object], steps: int,
                    trace_gz: Path | None = None) -> list[tuple[str, float, float]]:
    """Call ``run`` ``steps`` times under torch.profiler (CUDA activity when CUDA is there) and return the kernel
    intervals of its Chrome trace. The trace goes to a temporary file, removed after; ``trace_gz``: kept there
    gzipped. The device is synchronized before and after, so the block holds ``run``'s kernels only."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            run()
        if cuda:
            torch.cuda.synchronize()
    fd, raw = tempfile.mkstemp(suffix=".json", prefix="timeline_")
    os.close(fd)
    try:
        prof.export_chrome_trace(raw)
        kernels = kernel_intervals(raw)
        if trace_gz is not None:
            with open(raw, "rb") as src, gzip.open(trace_gz, "wb") as dst:
                shutil.copyfileobj(src, dst)
    finally:
        os.unlink(raw)
    return kernels
