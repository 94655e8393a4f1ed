"""Decode the next layer's weight on a side stream while the current one computes.

Decoding is memory-bound and the matrix products are compute-bound, so they
overlap well (codec.md §8.2). The prefetcher learns the order in which
``CompressedLinear`` forwards run (outside backward) and, after each decode,
launches the decode of the weight that comes next: the following one in
forward, the preceding one in backward. The prefetched buffer is tagged with
the weight's version, so a prefetch that turns out useless (a weight updated in
between, a different call order, checkpoint recompute) is simply not used; the
consumer waits on the prefetch's CUDA event, so it never reads a half-written
buffer. CPU tensors are never prefetched.
"""

from __future__ import annotations

import torch

from neutrain.nn.buffers import DECODE_BUFFERS


class Prefetcher:
    """Side-stream decode-ahead for compressed layers (CUDA only).

    Attributes:
        enabled: switch prefetching off for debugging or A/B timing.
        launched: prefetch decodes started (``DECODE_BUFFERS.prefetch_hits`` counts the used ones).
    """

    def __init__(self):
        self.enabled = True
        self.launched = 0
        self._next: dict[int, object] = {}
        self._prev: dict[int, object] = {}
        self._last = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def after_forward_decode(self, weight) -> None:
        if torch._C._current_graph_task_id() == -1:  # a real forward, not a checkpoint recompute
            last = self._last
            if last is not None and last is not weight:
                self._next[id(last)] = weight
                self._prev[id(weight)] = last
            self._last = weight
        self._launch(self._next.get(id(weight)))

    def after_backward_decode(self, weight) -> None:
        self._launch(self._prev.get(id(weight)))

    def _launch(self, target) -> None:
        if not self.enabled or target is None or target.device.type != "cuda" or target.large:
            return
        if DECODE_BUFFERS.holds(target):
            return
        main = torch.cuda.current_stream(target.device)
        side = self._streams.get(target.device)
        if side is None:
            side = self._streams[target.device] = torch.cuda.Stream(target.device)
        slot = DECODE_BUFFERS.slot_for(target)
        out = DECODE_BUFFERS.view(target, slot)  # allocated on the main stream, tagged now
        side.wait_stream(main)  # earlier users of this buffer must be done before it is overwritten
        with torch.cuda.stream(side):
            target.ct.decompress(out=out)
            event = torch.cuda.Event()
            event.record(side)
        DECODE_BUFFERS.set_event(target, slot, event)
        self.launched += 1


PREFETCHER = Prefetcher()
"""The process-wide prefetcher used by ``CompressedLinear``."""
