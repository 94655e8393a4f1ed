"""One decode step captured as a CUDA graph and replayed per token: ShadowKV's fused step, or a static full cache.

Why: on the H200 at 64K (Llama-3-8B shapes, batch 32) ShadowKV's fused step spent 21 ms of 61 in the chunk
selection, which moves ~100 MB a layer: the step waits on Python launching dozens of small kernels a layer through
transformers' eager forward. A replayed graph launches them all at once.

A graph replays the kernels, shapes and addresses of the one pass it captured, so everything a step derives on the
host must either live on the device or not matter to a one-token step:

* positions: transformers computes them from ``cache.get_seq_length()`` (a host count for ShadowKV); here they are
  a static ``position_ids`` tensor that the graph advances in place after the forward;
* the causal mask: for one query token without a padding mask, transformers' SDPA mask is None unless the cache
  is ``is_compileable`` (nothing captured); a ``StaticLayer`` cache builds it on the device from its device-held
  length;
* the cache: ShadowKV's fused path writes new tokens at the tail's device-held length (``tail_len``) and its kernel
  reads up to it (:mod:`neutrain.eval.kv.shadowkv_fused_decode`); a ``StaticLayer`` writes at its
  ``cumulative_length`` tensor. ShadowKV's unfused path, a dense layer or a ``DynamicLayer`` grow by
  ``torch.cat`` (one shape a step) and are refused;
* host counts (a layer's ``seen`` and ``tail_count``, the cache's counters, the kernels' launch counters): the
  capture runs the Python once without running the GPU, so what that pass added is taken back and added again on
  the host per replay (:class:`HostCounts`): the counts stay what eager steps would have left.

The tail buffer's free slots bound the replays of one capture (:func:`capturable_steps`); when they are used up,
:meth:`CapturedDecodeStep.step` grows the buffers outside the graph and captures again (``recapture_when_full``),
or refuses in one line. The phase marks of ``kv_eval``'s step split are CUDA timing events the graph would hide:
capture is refused while they are being recorded, and so is the selection log (``log_selection``: a host list a
step appends to).

Example (CUDA)::

    step = capture_decode_step(model, cache, batch)
    for _ in range(64):
        logits = step.step()      # the graph's output tensor: read or copy it before the next step
"""

from __future__ import annotations

import torch
from transformers.cache_utils import StaticLayer

from ... import compat
from .shadowkv import ShadowKVCache


class GraphCaptureError(RuntimeError):
    """A decode step that a CUDA graph cannot replay faithfully (the message says why and what would allow it)."""


def capturable_steps(cache) -> int:
    """Steps one capture of ``cache``'s decode step can replay, or :class:`GraphCaptureError` naming why none.

    ShadowKV: fused decode on, every layer sparse on the fused path, no phase marks being recorded; the count is
    the tail buffers' fewest free slots (a layer not yet in buffers counts as ``tail_capacity``, which its move into
    them gives). A cache of ``StaticLayer`` layers: its fewest free positions (a device read, outside any capture).
    """
    if isinstance(cache, ShadowKVCache):
        opt = cache.options
        if not opt.fused_decode:
            raise GraphCaptureError("ShadowKV's unfused decode grows its tail with torch.cat every step (a new shape "
                                    "each step): capture needs fused_decode=True")
        if opt.exact_keys:
            raise GraphCaptureError("exact_keys decodes on the unfused path (a new shape each step): capture needs "
                                    "exact_keys=False")
        if opt.log_selection:
            raise GraphCaptureError("log_selection keeps each step's chunk ids on the host (a replay would keep "
                                    "none, and rewrite the captured ones): capture needs log_selection=False")
        if cache.phase_events is not None:
            raise GraphCaptureError("the step's phase marks are being recorded (CUDA timing events inside a graph "
                                    "time the capture, not the replays): capture with phase_events None")
        for i, layer in enumerate(cache.layers):
            if layer.mode != "sparse":
                raise GraphCaptureError(f"layer {i} is {layer.mode}, not sparse (its keys grow by torch.cat every "
                                        f"step): capture after a prefill of at least min_prefill "
                                        f"({opt.min_prefill}) tokens")
        if cache.uva_failed and not opt.fused_store_reads and any(layer.offloaded for layer in cache.layers):
            raise GraphCaptureError("the offloaded values are gathered on the host (no UVA kernel here), which "
                                    "synchronizes each step: capture needs the gather kernel or fused_store_reads")
        return min(layer._tail_kbuf.shape[2] - layer.tail_count if layer.tail_len is not None
                   else max(1, opt.tail_capacity) for layer in cache.layers)
    layers = getattr(cache, "layers", None)
    if not layers or not all(isinstance(layer, StaticLayer) and layer.is_initialized for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers or ()}) or [type(cache).__name__]
        raise GraphCaptureError(f"a cache of {', '.join(kinds)} changes its tensors' shapes or reads host lengths "
                                "each step: capture takes a ShadowKVCache on its fused path or initialized "
                                "StaticLayer layers")
    return min(layer.max_cache_len - int(layer.cumulative_length) for layer in layers)


def _get(holder, key):
    return holder[key] if isinstance(holder, dict) else getattr(holder, key)


def _set(holder, key, value) -> None:
    if isinstance(holder, dict):
        holder[key] = value
    else:
        setattr(holder, key, value)


class HostCounts:
    """The host-side counts a decode step of ``cache`` advances, so that a step whose Python ran once (the capture)
    and whose GPU work is replayed counts each replay: :meth:`snapshot` them, :meth:`delta` what one pass added,
    :meth:`restore` the snapshot, :meth:`advance` by the delta once per replay.

    ShadowKV's: each layer's ``seen`` and ``tail_count`` (with its ``tail_k``/``tail_v`` views re-cut to the count),
    the cache's ``counters`` and the Triton kernels' launch counters. A ``StaticLayer`` cache keeps its length on
    the device: nothing to count here.
    """

    def __init__(self, cache):
        self.cache = cache
        self.fields: list[tuple[object, str]] = []
        if isinstance(cache, ShadowKVCache):
            for layer in cache.layers:
                self.fields += [(layer, "seen"), (layer, "tail_count")]
            self.fields += [(cache.counters, key) for key in cache.counters]
            if torch.cuda.is_available():
                from ...kernels import shadowkv, shadowkv_fused_decode  # lazy: Triton, CUDA path only

                for counters in (shadowkv.COUNTERS, shadowkv_fused_decode.COUNTERS):
                    self.fields += [(counters, key) for key in counters]
        self.per_step = [0] * len(self.fields)

    def snapshot(self) -> list[int]:
        return [_get(holder, key) for holder, key in self.fields]

    def restore(self, values: list[int]) -> None:
        for (holder, key), value in zip(self.fields, values):
            _set(holder, key, value)
        self._recut_tails()

    def delta(self, before: list[int]) -> list[int]:
        """What the pass since ``before`` added to each count; kept as the per-step amount."""
        self.per_step = [now - then for now, then in zip(self.snapshot(), before)]
        return self.per_step

    def advance(self, steps: int = 1) -> None:
        """Count ``steps`` more decode steps, each adding what the captured pass did."""
        for (holder, key), add in zip(self.fields, self.per_step):
            if add:
                _set(holder, key, _get(holder, key) + add * steps)
        self._recut_tails()

    def _recut_tails(self) -> None:
        if isinstance(self.cache, ShadowKVCache):
            for layer in self.cache.layers:
                if layer.tail_len is not None:
                    layer.tail_k = layer._tail_kbuf[:, :, : layer.tail_count]
                    layer.tail_v = layer._tail_vbuf[:, :, : layer.tail_count]


def _device_lengths(cache) -> list[torch.Tensor]:
    """The device-held lengths a step advances (ShadowKV's ``tail_len``, a ``StaticLayer``'s
    ``cumulative_length``): a warm-up step that ran for real is undone by writing them back."""
    if isinstance(cache, ShadowKVCache):
        return [layer.tail_len for layer in cache.layers]
    return [layer.cumulative_length for layer in cache.layers]


def start_positions(cache, batch: int, device) -> torch.Tensor:
    """``[batch, 1]`` int64: the position of the next token, as transformers derives it from the cache's length
    (``get_seq_length``: a host count for ShadowKV, a device tensor for ``StaticLayer``)."""
    seen = cache.get_seq_length()
    start = seen.to(device=device, dtype=torch.long) if torch.is_tensor(seen) else torch.tensor(seen, device=device)
    return start.reshape(1, 1).expand(batch, 1).clone()


def decode_step(model, cache, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The step a graph captures, runnable eagerly: ``model``'s forward of ``ids`` [batch, 1] at ``positions``
    [batch, 1] (given, so transformers reads no host length for them) over ``cache``, then ``positions += 1`` in
    place on their device. Returns the logits [batch, 1, vocab]."""
    out = model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1,
                **{compat.cache_forward_kwarg(model): cache})
    positions.add_(1)
    return out.logits


class CapturedDecodeStep:
    """A one-token decode step of ``model`` with ``cache`` as a CUDA graph (build with :func:`capture_decode_step`).

    Attributes:
        ids: the static ``[batch, 1]`` input ids (:meth:`step` copies new ones in).
        positions: the static ``[batch, 1]`` positions; each replay advances them by one on the device.
        logits: the graph's output, ``[batch, 1, vocab]``, overwritten by every replay.
        steps_left: replays this capture allows (the tail's free slots minus the replays so far).
        replays, captures, replays_this_capture: counted on the host.
    """

    def __init__(self, model, cache, ids: torch.Tensor, positions: torch.Tensor, warmup: int,
                 recapture_when_full: bool, positions_from_cache: bool = True):
        self.model, self.cache, self.ids, self.positions = model, cache, ids, positions
        self.positions_from_cache = positions_from_cache
        # at least one warm-up: Triton compiles a kernel on its first call, which a capture cannot hold
        self.warmup, self.recapture_when_full = max(1, warmup), recapture_when_full
        self.host = HostCounts(cache)
        self.graph, self.logits, self.steps_left = None, None, 0
        self.replays = self.captures = self.replays_this_capture = 0
        self.capture()

    def _forward(self) -> torch.Tensor:
        return decode_step(self.model, self.cache, self.ids, self.positions)

    def capture(self) -> None:
        """Warm up on a side stream (Triton compiles, cuBLAS picks its kernels), each warm-up step undone, then
        capture one step; the capture's own host counts are taken back and kept as the per-replay amount."""
        cache = self.cache
        if isinstance(cache, ShadowKVCache):
            for layer in cache.layers:  # what the first fused step would do, before any shape is captured
                if layer.tail_len is None:
                    layer._tail_buffers()
            if capturable_steps(cache) < 1:  # a full tail grows here, outside the graph, as an eager step would
                for layer in cache.layers:
                    layer._tail_buffers()
        steps = capturable_steps(cache)
        if steps < 1:
            raise GraphCaptureError("the StaticLayer cache is full at its max_cache_len: no position is left for a "
                                    "captured step to write")
        lengths = _device_lengths(cache)
        saved = [t.clone() for t in (*lengths, self.positions)]
        before = self.host.snapshot()
        side = torch.cuda.Stream(self.ids.device)
        side.wait_stream(torch.cuda.current_stream(self.ids.device))
        with torch.inference_mode():
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    self._forward()
                    for t, value in zip((*lengths, self.positions), saved):
                        t.copy_(value)
                    self.host.restore(before)
            torch.cuda.current_stream(self.ids.device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(self.graph):
                    self.logits = self._forward()
            except RuntimeError as exc:
                self.host.restore(before)
                raise GraphCaptureError(f"the decode step could not be captured (something in it reads the "
                                        f"device from the host): {str(exc).splitlines()[0]}") from exc
        self.host.delta(before)
        self.host.restore(before)
        self.steps_left, self.captures, self.replays_this_capture = steps, self.captures + 1, 0
        if isinstance(cache, ShadowKVCache):
            self.expected_seen, self.captured_buffer = cache.layers[0].seen, cache.layers[0]._tail_kbuf

    def recapture(self) -> None:
        """Capture again from the cache's present state: a full ShadowKV tail grows first (outside the graph, its
        buffers reallocated with ``tail_capacity`` free slots), positions taken from the cache were not given are
        taken from it again; a full ``StaticLayer`` cache is refused."""
        self.graph = self.logits = None  # the old graph's memory pool is released before the new capture
        torch.cuda.synchronize(self.ids.device)
        if self.positions_from_cache:
            with torch.inference_mode():
                self.positions.copy_(start_positions(self.cache, self.ids.shape[0], self.ids.device))
        self.capture()

    def _moved_outside(self) -> bool:
        """Whether the ShadowKV cache took steps outside this graph (an eager step moved its length, or regrew
        the buffers the graph writes): a replay would then write and read where the capture's state was. Host
        checks only; a ``StaticLayer`` cache's length is on the device (capture again after eager steps)."""
        if not isinstance(self.cache, ShadowKVCache):
            return False
        first = self.cache.layers[0]
        return first.seen != self.expected_seen or first._tail_kbuf is not self.captured_buffer

    def step(self, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step by replaying the graph (``input_ids`` [batch, 1] copied in first when given): the logits
        ``[batch, 1, vocab]``, the graph's own tensor (copy it to keep it past the next step). A cache moved by
        steps outside the graph is captured again first."""
        if self._moved_outside():
            self.recapture()
        if self.steps_left == 0:
            if not self.recapture_when_full:
                raise GraphCaptureError(f"the captured step has replayed the {self.replays_this_capture} steps its "
                                        "free positions allow (a ShadowKV tail's free slots, a StaticLayer's "
                                        "positions left): call recapture() (or recapture_when_full=True)")
            self.recapture()
        if input_ids is not None:
            with torch.inference_mode():
                self.ids.copy_(input_ids, non_blocking=True)
        self.graph.replay()
        self.host.advance()
        if isinstance(self.cache, ShadowKVCache):
            self.expected_seen = self.cache.layers[0].seen
        self.steps_left -= 1
        self.replays += 1
        self.replays_this_capture += 1
        return self.logits


def capture_decode_step(model, cache, batch: int | None = None, input_ids: torch.Tensor | None = None,
                        positions: torch.Tensor | None = None, warmup: int = 2,
                        recapture_when_full: bool = True) -> CapturedDecodeStep:
    """Capture one one-token decode step of ``model`` over ``cache`` as a CUDA graph.

    Args:
        batch: rows of the step (or give ``input_ids``).
        input_ids: ``[batch, 1]`` first input ids (default: zeros; :meth:`CapturedDecodeStep.step` takes new ones).
        positions: ``[batch, 1]`` position of the next token (default: the cache's length, as transformers
            derives it).
        warmup: eager steps on a side stream before the capture, each undone (at least one).
        recapture_when_full: when the tail's free slots are used up, grow and capture again (else refuse).

    Raises:
        GraphCaptureError: the step cannot be replayed faithfully (unfused or dense ShadowKV, a cache that grows by
            concatenation, phase marks on, no CUDA); the message says what would allow it.
    """
    capturable_steps(cache)
    if input_ids is None and batch is None:
        raise ValueError("capture_decode_step needs batch or input_ids")
    if not torch.cuda.is_available():
        raise GraphCaptureError("a CUDA graph needs CUDA: on this machine the decode step runs eagerly")
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise GraphCaptureError(f"the model is on {device}: a CUDA graph needs it on a CUDA device")
    with torch.inference_mode():
        ids = (torch.zeros(batch, 1, dtype=torch.long, device=device) if input_ids is None
               else input_ids.to(device=device, dtype=torch.long).reshape(-1, 1).clone())
        pos = start_positions(cache, ids.shape[0], device) if positions is None else positions.to(device).clone()
    return CapturedDecodeStep(model, cache, ids, pos, warmup, recapture_when_full, positions is None)
