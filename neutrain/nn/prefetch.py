"""Decode the next weight on a side stream while the current one computes, in the recorded order.

Decoding is memory-bound and the matrix products are compute-bound, so they
overlap well (docs/codec.md §8.2), provided the decode ahead is the weight that
is asked for next. The order is not guessed: the prefetcher records the
sequence of ``CompressedLinear`` decode requests of one *cycle* (a forward with
grad, then its backward: checkpoint recomputes and the backward's own decodes,
in the order autograd runs them), and in the next cycle, after request ``i``
matched entry ``i`` of that record, launches the decode of entry ``i + 1`` onto
a side stream, into the layer slot the next synchronous decode would use anyway
(:mod:`neutrain.nn.buffers`; no extra memory). A cycle ends where a forward
request follows a backward one; the new record replaces the plan, so a changed
order (another batch shape, checkpointing switched on) is learnt in one cycle.

Never a wrong weight: a prefetched slot is tagged with the weight's version at
launch, so a weight re-encoded in between is decoded again; the consumer waits
on the prefetch's CUDA event (stream to stream, no host sync); and the first
request that departs from the plan ends prefetching for the rest of the cycle
(counted in :attr:`Prefetcher.mismatches`): every later request decodes
synchronously, as without a prefetcher. Forwards without grad (evaluation,
generation) are neither recorded nor prefetched.

Off by default (``PREFETCHER.enabled``). The earlier prefetcher guessed the
order from forward alone (the next weight in forward, the previous one in
backward) and lost on an H100 (Llama-3-8B, ``benchmarks/memory/train_memory.py`` d
against q): 709 decodes instead of 611, 6,630 against 6,742 tok/s; the wrong
guesses fell in the recomputes and at layer boundaries in backward. A side-stream
decode also shares HBM bandwidth with the GEMM it hides behind, so it pays most
where the GEMMs are compute-bound (large batches). CPU weights are never
prefetched (``eager_cpu`` decodes them ahead synchronously, for tests of the
bookkeeping only); weights with a kept decode buffer need no prefetch.
"""

from __future__ import annotations

import weakref

import torch

from neutrain.compat.autograd import in_backward
from neutrain.nn.buffers import DECODE_BUFFERS

MAX_RECORD = 1 << 16
"""Requests recorded per cycle at most: a cycle that never reaches a backward must not grow without end."""


class Prefetcher:
    """Side-stream decode-ahead for compressed layers, in the order recorded one cycle earlier.

    Attributes:
        enabled: switch prefetching (and recording) on; off by default.
        launched: prefetch decodes started (``DECODE_BUFFERS.prefetch_hits`` counts the used ones).
        mismatches: cycles that departed from the recorded order (and finished synchronously).
        eager_cpu: on CPU, decode ahead at once instead of skipping (tests of the bookkeeping).

    Example:
        >>> from neutrain.compress import compress
        >>> from neutrain.nn import CompressedWeight
        >>> a, b = (CompressedWeight(compress(torch.randn(4, 4).bfloat16()), name=n) for n in "ab")
        >>> prefetcher = Prefetcher()
        >>> prefetcher.enabled = True
        >>> prefetcher.after_decode(a); prefetcher.after_decode(b)  # a forward with grad: recorded
        >>> prefetcher.after_decode(a, grad_enabled=False)  # no backward follows: not recorded
        >>> [w.name for w in prefetcher.recording], prefetcher.plan
        (['a', 'b'], [])
    """

    def __init__(self):
        self.enabled = False
        self.eager_cpu = False
        self.launched = 0
        self.mismatches = 0
        # Weak references: this process-wide object must not keep a dropped model's weights alive.
        self._plan: list[weakref.ref] = []  # the last complete cycle's requests
        self._record: list[weakref.ref] = []  # this cycle's requests so far
        self._on_plan = False  # every request of this cycle so far matched the plan
        self._last_backward = False  # the previous recorded request ran in backward
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @property
    def plan(self) -> list:
        """The weights of the recorded cycle, in request order (the ones still alive)."""
        return [w for w in (ref() for ref in self._plan) if w is not None]

    @property
    def recording(self) -> list:
        """The weights requested so far in the current cycle."""
        return [w for w in (ref() for ref in self._record) if w is not None]

    def reset(self) -> None:
        """Forget the recorded order (e.g. before timing another model)."""
        self._plan, self._record, self._on_plan, self._last_backward = [], [], False, False

    def after_decode(self, weight, grad_enabled: bool = True) -> None:
        """Called by ``CompressedLinear`` right after it obtained ``weight`` (decoded or cached).

        ``grad_enabled``: the grad mode the module was called under (a forward without grad has no
        backward to plan for: it is neither recorded nor prefetched).
        """
        if not self.enabled:
            return
        backward = in_backward()
        if not backward and not grad_enabled:
            return
        if not backward and self._last_backward:  # a forward after a backward: the cycle is complete
            self._plan, self._record, self._on_plan = self._record, [], True
        self._last_backward = backward
        position = len(self._record)
        if position >= MAX_RECORD:
            self._on_plan = False
            return
        self._record.append(weakref.ref(weight))
        if not self._on_plan:
            return
        if position < len(self._plan) and self._plan[position]() is weight:
            if position + 1 < len(self._plan):
                self._launch(self._plan[position + 1]())
        else:
            self._on_plan = False  # synchronous decodes for the rest of this cycle
            self.mismatches += 1

    def _launch(self, target) -> None:
        # Offloaded: the payload may not be on the device; grouped: decoded with its layer (neutrain.nn.groups).
        # Released: a stand-in's decode allocates, so it runs on the main stream when asked.
        if target is None or target.large or target.home is not None or target.group is not None or target.released:
            return
        cuda = target.device.type == "cuda"
        if not (cuda or self.eager_cpu) or DECODE_BUFFERS.keeps(target) or DECODE_BUFFERS.holds(target):
            return
        slot = DECODE_BUFFERS.slot_for(target)
        if not cuda:
            target.ct.decompress(out=DECODE_BUFFERS.view(target, slot, for_main_stream=False))
            DECODE_BUFFERS.set_event(target, slot, None)
            self.launched += 1
            return
        main = torch.cuda.current_stream(target.device)
        side = self._streams.get(target.device)
        if side is None:
            side = self._streams[target.device] = torch.cuda.Stream(target.device)
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
