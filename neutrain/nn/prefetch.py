"""Decode the next layer's weight on a side stream while the current one computes.

Decoding is memory-bound and the matrix products are compute-bound, so they
overlap well (docs/codec.md §8.2). The prefetcher learns the order in which
``CompressedLinear`` forwards run (outside backward) and, after each decode,
launches the decode of the weight that comes next: the following one in
forward, the preceding one in backward. The prefetched buffer is tagged with
the weight's version, so a prefetch that turns out useless (a weight updated in
between, a different call order, checkpoint recompute) is simply not used; the
consumer waits on the prefetch's CUDA event, so it never reads a half-written
buffer. CPU tensors are never prefetched.

Off by default: measured on an H200 (Llama shape, hidden 2048, 8 layers,
4 x 1024 tokens, activation checkpointing, LOMO), steps took 0.181 s with
prefetching against 0.161 s without (dense: 0.102 s). That was when the codec's
re-encode read its stream size back to the host once per updated tensor, which
drained the GPU queue in every layer's backward. Measured again once a training step
made no host sync at all (H100, Llama-3-8B, ``benchmarks/train_memory.py`` variants d
and q, commit 4675abe): still slower, 5,528 against 5,702 tok/s at batch 8 and 895
against 1,456 at batch 1. The profile shows why: 709 decodes instead of 611 (prefetches
of the wrong weight in the recompute and backward orders, thrown away) and 94 ms of
decode kernel time instead of 41 (a side-stream decode shares HBM bandwidth with the
GEMM it hides behind, and both slow down). What would make it pay: predict the
backward order exactly (the reverse of forward, recompute included) and decode only
when the GEMM is compute-bound (large batches).
"""

from __future__ import annotations

import weakref

import torch

from neutrain.compat.autograd import in_backward
from neutrain.nn.buffers import DECODE_BUFFERS


class Prefetcher:
    """Side-stream decode-ahead for compressed layers (CUDA only).

    Attributes:
        enabled: switch prefetching off for debugging or A/B timing.
        launched: prefetch decodes started (``DECODE_BUFFERS.prefetch_hits`` counts the used ones).
    """

    def __init__(self):
        self.enabled = False
        self.launched = 0
        # Weak on both sides: this process-wide object must not keep a dropped model's weights alive.
        self._next: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # weight -> ref(next weight)
        self._prev: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # weight -> ref(previous weight)
        self._last = None  # ref(last weight decoded in forward)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def after_forward_decode(self, weight) -> None:
        if not in_backward():  # a real forward, not a checkpoint recompute
            last = self._last() if self._last is not None else None
            if last is not None and last is not weight:
                self._next[last] = weakref.ref(weight)
                self._prev[weight] = weakref.ref(last)
            self._last = weakref.ref(weight)
        self._launch(self._next.get(weight))

    def after_backward_decode(self, weight) -> None:
        self._launch(self._prev.get(weight))

    def _launch(self, target_ref) -> None:
        target = target_ref() if target_ref is not None else None
        if not self.enabled or target is None or target.device.type != "cuda" or target.large \
                or target.home is not None:  # offloaded: its payload may not be on the device
            return
        if DECODE_BUFFERS.holds(target):
            return
        main = torch.cuda.current_stream(target.device)
        side = self._streams.get(target.device)
        if side is None:
            side = self._streams[target.device] = torch.cuda.Stream(target.device)
        slot = DECODE_BUFFERS.slot_for(target)
        released = DECODE_BUFFERS.released_event(target, slot)
        out = DECODE_BUFFERS.view(target, slot, for_main_stream=False)  # allocated on the main stream
        # The slot's previous reader must be done before it is overwritten. Waiting for that
        # reader only (not for all main-stream work) lets this decode overlap the current GEMM.
        # A freshly allocated buffer may reuse memory main-stream work still touches: wait for all.
        if released is None or DECODE_BUFFERS.allocated:
            side.wait_stream(main)
        else:
            side.wait_event(released)
        with torch.cuda.stream(side):
            target.ct.decompress(out=out)
            event = torch.cuda.Event()
            event.record(side)
        DECODE_BUFFERS.set_event(target, slot, event)
        self.launched += 1


PREFETCHER = Prefetcher()
"""The process-wide prefetcher used by ``CompressedLinear``."""
