"""The KV throughput part's captured-step rows: the decode step replayed as a CUDA graph
(``neutrain/eval/kv/decode_graph.py`` for ShadowKV), the full cache's step captured for the baseline, and the
kernel timeline of their replays.

Why a graphed full cache beside the graphed ShadowKV: a graph removes the host's launch time from any step, the
full cache's too (its eager step launches the same projections, norms and MLP kernels), so ShadowKV's graphed
figure is set against the full cache's graphed one.

How the full cache's step is captured: once per length (:class:`PerLengthGraph`). The eager full cache
(``PreallocatedLayer``) slices its buffer to a host-held length, one shape a length, and attends it with SDPA
unmasked (the fastest backend of the ``full`` row). A single graph would need the whole buffer under a mask built
on the device (transformers' ``StaticLayer``, which ``capture_decode_step`` takes), and with a mask transformers'
SDPA path repeats the keys and values for every query head (``repeat_kv``: 4x the cache's bytes a layer at
Llama-3-8B's GQA) and leaves the flash and cuDNN kernels: a slower step than the eager one, no fair baseline. A
graph captured at each length replays exactly the eager step's kernels and bytes without the launches: what no
full-cache decode can beat, so the ratio against it is the conservative one. The capture runs before each timed
replay, outside the timing.

Why a replay timeline: the graph hides the step's phases (no CUDA events inside it), so where a replayed step
spends its time is read from the profiler's kernels instead (:func:`replay_timeline`, ``benchmarks/memory/_timeline.py``).
"""

from __future__ import annotations

import re
import time

import torch

from benchmarks.memory._timeline import Groups, profile_kernels, timeline_table
from neutrain import compat

SHADOWKV_KERNEL_GROUPS: Groups = (
    ("shadowkv_fused_attention", re.compile(r"_shadowkv_fused_decode_kernel")),
    ("shadowkv_gather", re.compile(r"gather_chunks")),
    # The fused step's attention is its own kernel, so a softmax there is the selection's (softmax over the
    # landmark scores, then top-k); the scores' einsum is a GEMM and stays in ``product``.
    ("shadowkv_selection", re.compile(r"topk|radixFindKth|computeBlockwise|bitonicSort|softmax", re.IGNORECASE)),
)
"""ShadowKV's own kernels, grouped ahead of ``_timeline.GROUPS`` (which would file them under ``other`` or
``attention``)."""

MINICACHE_KERNEL_GROUPS: Groups = (
    ("minicache_attention", re.compile(r"_segment_kernel|_combine_kernel")),
    # the new token's 4-bit save: min/max, scale and the codes' packing, each a small pointwise kernel
    ("minicache_quantize", re.compile(r"amin|amax|reduce_kernel|bitwise|clamp_min|round", re.IGNORECASE)),
)
"""MiniCache's own kernels, grouped ahead of ``_timeline.GROUPS``: its decode's time against the 4-bit save's and
the model's products, and the step's idle share (an eager step: a host that launches slower than the GPU runs
shows as idle)."""

REPLAY_TIMELINE_STEPS = 3
"""Replays in a graphed row's profiled block: enough for a per-step median, few enough for ShadowKV's tail slots
(256 a capture) and the row's time."""


class PerLengthGraph:
    """The decode step of a cache whose layers keep a host-held ``length`` (``PreallocatedLayer``), captured anew
    at each length: :meth:`prepare` warms up on a side stream (the lengths put back), then captures one step,
    whose Python pass leaves the lengths where the replay leaves the buffers; :meth:`step` replays it."""

    def __init__(self, model, cache, batch: int, warmup: int = 1):
        self.model, self.cache, self.warmup = model, cache, max(1, warmup)
        self.kwarg = compat.cache_forward_kwarg(model)
        device = next(model.parameters()).device
        with torch.inference_mode():
            self.ids = torch.randint(0, 100, (batch, 1), device=device)
        self.graph = self.logits = None
        self.captures = 0

    def _forward(self):
        return self.model(input_ids=self.ids, use_cache=True, logits_to_keep=1, **{self.kwarg: self.cache}).logits

    def prepare(self) -> None:
        self.graph = self.logits = None  # the last length's graph and memory pool, released before the next capture
        lengths = [layer.length for layer in self.cache.layers]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode():
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    self._forward()
                    for layer, length in zip(self.cache.layers, lengths):
                        layer.length = length
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.logits = self._forward()  # the graph's output, rewritten by each replay
        self.graph, self.captures = graph, self.captures + 1

    def step(self) -> None:
        self.graph.replay()


def graph_against_eager(captured, eager_step) -> dict:
    """One replay of ``captured`` and then one eager step of the same cache, each between CUDA events, and the
    eager step's host wall clock: a graph hides the step's phases (no marks inside it), so what it shows is the
    whole step's GPU time with and without the host launching each kernel. Run last: the eager step moves the
    cache past the captured positions."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    captured.step()
    end.record()
    torch.cuda.synchronize()
    graph_ms = begin.elapsed_time(end)
    t0 = time.perf_counter()
    with torch.inference_mode():
        begin.record()
        eager_step()
        end.record()
    host_ms = (time.perf_counter() - t0) * 1e3  # until the host has launched the whole step
    torch.cuda.synchronize()
    return {"graph_step_ms": round(graph_ms, 3), "eager_step_ms": round(begin.elapsed_time(end), 3),
            "eager_step_host_launch_ms": round(host_ms, 3),
            "phases": "hidden by the graph (no marks inside it): the eager row's step_split has them"}


def replay_timeline(step, cuda: bool, groups: Groups = (), replays: int = REPLAY_TIMELINE_STEPS) -> dict:
    """The kernel timeline of ``replays`` more replays of a captured step (``step``), for the row's record:
    ``replay_timeline`` (kernels, span, busy and idle per step, the gaps, device time per group, the top 15
    kernels). Run after the timed steps, so the profiler costs the timing nothing. Never fails the row: any
    error is recorded as ``replay_timeline_error``; without CUDA there is no graph to trace
    (``replay_timeline_skipped``)."""
    if not cuda:
        return {"replay_timeline_skipped": "needs CUDA: CUPTI traces the kernels inside a graph's replay"}
    try:
        with torch.inference_mode():
            kernels = profile_kernels(step, replays)
        table = timeline_table(kernels, replays, groups=groups, top=15)
    except Exception as exc:  # noqa: BLE001 - the row's timing is kept whatever the profiler does
        return {"replay_timeline_error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    if "error" in table:
        return {"replay_timeline_error": table["error"]}
    return {"replay_timeline": {"replays": replays, **table}}
