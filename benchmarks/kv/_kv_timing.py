"""The KV-cache benchmark's throughput timing: the decode step timed, and the kernels it ran recorded.

``timed`` gives a row its tokens/s from the median of synchronized decode steps, as many as the row's deadline
leaves room for (``steps_within``), with the GPU's clocks on either side (``benchmarks/_gpu_state.py``).
``kernel_record`` profiles one more step for the attention kernel that ran: the full cache's 64K figure moved
between runs of the same code, and the SDPA backend is the first suspect. ``shadowkv_step_split`` times one
more ShadowKV step by phase with CUDA events. Nothing here builds a cache (``_kv_caches``) or knows the rows
(``_kv_throughput``).
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks._gpu_state import around, attention_kernel
from benchmarks.kv._kv_plan import CHEAP_STEPS_SECONDS, MIN_STEPS
from neutrain import compat


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def steps_within(deadline: float | None, step_seconds: float, most: int) -> int:
    """Timed steps that fit before ``deadline`` at ``step_seconds`` each, the profiled step after them left
    room for: at most ``most`` (all of them without a deadline), at least one, and at least ``MIN_STEPS`` when
    those take under ``CHEAP_STEPS_SECONDS`` together (a cheap row's median is not cut to one step)."""
    if deadline is None:
        return most
    fit = int((deadline - time.time()) / max(step_seconds, 1e-6)) - 1
    least = MIN_STEPS if step_seconds * MIN_STEPS <= CHEAP_STEPS_SECONDS else 1
    return max(min(least, most), min(most, fit))


def eager_step(model, cache, batch):
    """One decode step through the model's forward (transformers derives the positions from the cache)."""
    kwarg = compat.cache_forward_kwarg(model)
    ids = torch.randint(0, 100, (batch, 1), device=next(model.parameters()).device)
    return lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kwarg: cache})


def step_times(model, cache, batch, steps, warmup=2, deadline=None, step=None, prepare=None) -> list[float]:
    """Seconds of each timed decode step (synchronized one by one), after ``warmup`` steps; the count is
    ``steps``, or fewer when the row's ``deadline`` comes first (``steps_within``: at least one). ``step``: the
    step to time (a captured graph's replay), else the model's eager forward; ``prepare``: run before each step,
    untimed (the capture of a graph per length)."""
    step = step or eager_step(model, cache, batch)
    prepare = prepare or (lambda: None)
    seconds, last = [], 0.0  # the last warm-up step's seconds: what a timed step is expected to take
    with torch.inference_mode():
        for _ in range(warmup):
            prepare()
            _sync()
            t0 = time.perf_counter()
            step()
            _sync()
            last = time.perf_counter() - t0
        for _ in range(steps_within(deadline, last, steps)):
            prepare()
            _sync()
            t0 = time.perf_counter()
            step()
            _sync()
            seconds.append(time.perf_counter() - t0)
    return seconds


def timed(model, cache, batch, steps, warmup: int = 2, deadline: float | None = None, step=None,
          prepare=None) -> dict:
    """Decode tokens/s and ms a step of ``cache`` at ``batch`` from the median timed step, with the GPU's clocks,
    power and temperature on either side of the timed steps (``benchmarks/_gpu_state.py``); ``step`` and
    ``prepare`` as ``step_times``."""
    left = None if deadline is None else round(deadline - time.time(), 1)
    seconds, state = around(lambda: step_times(model, cache, batch, steps, warmup, deadline, step, prepare))
    median = statistics.median(seconds)
    out = {"tokens_per_s": batch / median, "ms_per_step": median * 1e3, "timed_steps": len(seconds),
           "step_ms": [round(s * 1e3, 3) for s in seconds], "gpu_state": state}
    if len(seconds) < steps:
        out["steps_cut"] = (f"{len(seconds)} of {steps} timed steps: the row's cap had {left} s left after its "
                            f"build, and its warm-up showed {median:.2f} s a step")
    return out


def kernel_record(model, cache, batch, step=None) -> dict:
    """The attention ops one more decode step runs (``step``: a captured graph's replay, else the eager forward),
    and the kernel they name (after timing: the profiler costs nothing above)."""
    ops = attention_ops(model, cache, batch, step)
    return {"attention_ops": ops, "attention_kernel": attention_kernel(ops)}


def graph_kernel_record(model, cache, batch, step) -> dict:
    """``kernel_record`` of a graph's replay, or why the profiler could not trace it: the row's timing is kept."""
    try:
        return kernel_record(model, cache, batch, step=step)
    except RuntimeError as exc:
        return {"attention_ops": {}, "attention_kernel": None,
                "kernel_record_error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def attention_ops(model, cache, batch, step=None) -> dict[str, int]:
    """The attention ops and kernels one more decode step runs, by name, with their counts.

    Why: the full cache's decode step at 64K took 53 ms in one H100 run and 90 ms in another with the same
    code (benchmarks/kv/NOTES.md); the SDPA dispatcher's choice of backend (flash, efficient, cuDNN,
    math) is the first suspect, so each throughput figure records which one ran.
    """
    import re

    from torch.profiler import ProfilerActivity, profile

    step = step or eager_step(model, cache, batch)
    cuda = next(model.parameters()).is_cuda
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof, torch.inference_mode():
        step()
        _sync()
    # SDPA's backends, and neutrain's own decode kernels (MiniCache's segment/combine, ShadowKV's gather)
    pattern = re.compile(r"scaled_dot_product|attention|fmha|flash|cudnn|_segment_kernel|_combine_kernel|gather_chunks"
                         r"|_shadowkv_fused_decode_kernel",
                         re.IGNORECASE)
    return {e.key[:160]: e.count for e in prof.key_averages() if pattern.search(e.key)}


SHADOWKV_PHASES = ("selection", "gather_launch", "reconstruction", "gather_wait", "attention")


def shadowkv_step_split(model, cache, batch) -> dict:
    """One more decode step of a ShadowKV ``cache``, its time split by phase with CUDA events, summed over layers.

    Phases, in stream order inside each layer's sparse attention (``ShadowKVCache.mark``): ``selection``
    (landmark scores, top-k, chunk ids), ``gather_launch`` (the device rows' value gather and the launch of the
    host rows' gather on its side stream), ``reconstruction`` (low-rank key rebuild and RoPE), ``gather_wait``
    (the host gather not hidden behind the rebuild, and the join of the row blocks), ``attention`` (the
    concatenations and SDPA); ``rest`` is the step outside the sparse attention (projections, MLP, norms,
    sampling). ``host_gather_kernel_ms`` is the side stream's gather kernel itself (overlapping the phases).
    """
    kwarg = compat.cache_forward_kwarg(model)
    ids = torch.randint(0, 100, (batch, 1), device=next(model.parameters()).device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cache.phase_events = []
    try:
        with torch.inference_mode():
            begin.record()
            model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kwarg: cache})
            end.record()
        torch.cuda.synchronize()
        events = cache.phase_events
    finally:
        cache.phase_events = None
    main = [(name, ev) for name, ev in events if not name.startswith("host_gather")]
    phases = dict.fromkeys(SHADOWKV_PHASES, 0.0)
    for (_, e0), (name, e1) in zip(main, main[1:]):
        if name != "start":  # from one layer's end to the next one's start is "rest"
            phases[name] += e0.elapsed_time(e1)
    host = [ev for name, ev in events if name.startswith("host_gather")]
    step = begin.elapsed_time(end)
    out = {"step_ms": round(step, 3), **{f"{k}_ms": round(v, 3) for k, v in phases.items()},
           "rest_ms": round(step - sum(phases.values()), 3),
           "host_gather_kernel_ms": round(sum(a.elapsed_time(b) for a, b in zip(host[0::2], host[1::2])), 3),
           "layers": sum(1 for name, _ in main if name == "start")}
    return out
