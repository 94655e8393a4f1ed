"""Reusable decode buffers, shared by every compressed module.

Decoded weights never get their own allocation: they are written into a few
per-device buffers, each grown to the largest weight decoded into it.

* Two *layer* slots alternate, so that while one holds the weight being used,
  the other can receive the next weight, decoded ahead on a side stream
  (:mod:`neutrain.nn.prefetch`).
* One *large* slot holds the embedding/lm_head matrix (decoded for the chunked
  loss and for their updates), so the layer slots stay layer-sized. It is freed
  after each use (:meth:`DecodeBuffers.release_large`): a vocabulary-sized
  matrix (1 GiB for Llama-3-8B) must not stay allocated through the decoder's
  forward and backward.

:meth:`DecodeBuffers.reserve` (called once a model is converted, see
:func:`neutrain.nn.convert.mark_large_weights`) allocates every slot up front at
the size of the largest weight it will hold, the large slot first, and pins them
(the large slot only under the classic allocator, see below):
a slot that grows step by step, or a 1 GiB large slot freed and allocated again
around every loss, can let the caching allocator split its segment for other
tensors and open a new segment for the next request (hence one
preallocated pool). Measured on an H100 (Llama-3-8B, batch 1,
``benchmarks/memory/train_memory.py`` variants d and g): peak allocated and reserved
unchanged (12.79 / 14.35 GiB), device used 15.57 vs 15.66 GiB; the segment
map there shows a 2004 MiB segment wholly free after the step, a transient
elsewhere (``benchmarks/memory/NOTES.md``). Pinned slots are freed only by
:meth:`DecodeBuffers.clear`.

Under expandable segments (``neutrain train``'s default allocator setting) a freed
block's pages are reused by any later request, so the large slot is not pinned: it is
freed after each use, and the decoder layers' backward can use its memory (2 GiB for
the Llama-3-70B vocabulary matrix, the margin a 70B step at long context runs short of:
``benchmarks/memory/results.jsonl#train_70b``).

Each slot carries a tag ``(weight serial, version)`` naming what it holds, and,
after a prefetch, the CUDA event that marks the decode complete. A weight
decoded again while its tag is current (e.g. read by the optimizer right after
backward decoded it) is served from the buffer; an updated weight bumps its
version, so a stale buffer is never mistaken for current data.

*Kept* decodes: within a per-device byte budget (:attr:`DecodeBuffers.keep_bytes`),
a weight is decoded into a buffer of its own that lives as long as the weight, instead
of a shared slot. Its tag is the weight's version, so forward, a checkpoint recompute,
backward and the fused update's read share one decode per step, and the re-encode
(``write_``, a version bump) invalidates it: the next step decodes afresh. The budget
is the memory plan's: a full budget holds one dense copy of the model beside the
compressed one. It is on by default for CPU weights (1/8 of the host's memory), where the
dense copy is small next to what the machine has, and off on GPUs, whose slot budget
the memory planner counts on. ``NEUTRAIN_KEEP_DECODED_MIB`` sets it for every device
(``0``: off).
"""

from __future__ import annotations

import itertools
import os
import weakref

import torch

from neutrain.config.knobs import knob

_SERIALS = itertools.count()


def _identity(weight) -> int:
    """A number no other weight of this process ever gets (unlike ``id()``, which Python reuses
    once an object is freed: a new weight must never be served a dead weight's buffer; this
    happened across two models in one process on a GPU test run)."""
    serial = getattr(weight, "_buffer_serial", None)
    if serial is None:
        serial = weight._buffer_serial = next(_SERIALS)
    return serial


LAYER_SLOTS = ("layer0", "layer1")
LARGE_SLOT = "large"
HELD_SLOT = "held"
"""A third layer-sized slot, outside the two that alternate, for a consumer that needs three layer weights
decoded at once (the sequence-chunked MLP's gate, up and down, :mod:`neutrain.nn.chunked_mlp`): the third
decode into an alternating slot would overwrite the first while it is still read. Allocated on first use."""


def default_keep_bytes(device: torch.device) -> int:
    """Bytes of kept decodes allowed on ``device`` by default (see the module docstring).

    Example:
        >>> import os
        >>> os.environ["NEUTRAIN_KEEP_DECODED_MIB"] = "64"
        >>> default_keep_bytes(torch.device("cpu"))
        67108864
        >>> del os.environ["NEUTRAIN_KEEP_DECODED_MIB"]
        >>> default_keep_bytes(torch.device("cuda", 0))
        0
    """
    override = knob("NEUTRAIN_KEEP_DECODED_MIB")  # finite and in range: neutrain.config.knobs
    if override is not None:
        return int(override * 2**20)
    if device.type != "cpu":
        return 0
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 8
    except (ValueError, OSError, AttributeError):  # no sysconf (Windows): keep nothing rather than guess
        return 0


def expandable_segments() -> bool:
    """Whether the CUDA caching allocator was configured with expandable segments (read from the environment).

    Example:
        >>> import os
        >>> os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "max_split_size_mb:64,expandable_segments:True"
        >>> expandable_segments()
        True
        >>> del os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    """
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or ""
    options = dict(part.split(":", 1) for part in conf.replace(" ", "").split(",") if ":" in part)
    return options.get("expandable_segments", "").lower() == "true"


class DecodeBuffers:
    """Tagged decode buffers per (device, dtype, slot)."""

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._tags: dict[tuple, tuple] = {}
        self._events: dict[tuple, torch.cuda.Event] = {}  # prefetch into the slot done
        self._released: dict[tuple, torch.cuda.Event] = {}  # main stream done with the slot's last content
        self._recent: dict[tuple, str] = {}
        self._pinned: set[tuple] = set()  # slots allocated by reserve(): never shrunk or released
        self._lent: set[tuple] = set()  # large slots pinned by shared_large() only, until give_back_lent()
        self.prefetch_hits = 0
        self.allocated = False
        # Kept decodes: weight -> [its own buffer, the version it holds or None, finalizer]. Weak keys: a
        # dropped model's buffers go with it (the finalizer gives its bytes back to the budget).
        self._kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._kept_bytes: dict[torch.device, int] = {}
        self.keep_bytes: dict[torch.device, int] = {}  # budget per device; missing: default_keep_bytes
        # Called with the device before anything is decoded into its large slot, and with None on clear():
        # the layer groups (neutrain.nn.groups) share the large slot's memory and must give it up first.
        self.large_listeners: list = []

    def reserve(self, weights, pin_large: bool | None = None) -> int:
        """Allocate each slot once at the size of the largest of ``weights`` it will hold; return bytes.

        The large slot is allocated first, then both layer slots, so they sit together at
        the start of the model's working memory; the layer slots are pinned, and the large
        slot too unless ``pin_large`` is False (default: pinned unless the allocator uses
        expandable segments, see the module docstring). Calling it again (another model in
        the process) only grows slots.

        Example:
            >>> import torch
            >>> from neutrain.compress import compress
            >>> from neutrain.nn import CompressedWeight
            >>> w = CompressedWeight(compress(torch.randn(8, 4).bfloat16(), steps=16))
            >>> DecodeBuffers().reserve([w])  # two layer slots of 32 bf16 each
            128
        """
        sizes: dict[tuple, int] = {}
        for weight in weights:
            for slot in (LARGE_SLOT,) if weight.large else LAYER_SLOTS:
                key = (weight.device, weight.dtype, slot)
                sizes[key] = max(sizes.get(key, 0), weight.numel)
        for key in sorted(sizes, key=lambda k: k[2] != LARGE_SLOT):
            buffer = self._buffers.get(key)
            if buffer is None or buffer.numel() < sizes[key]:
                self._wait(key)
                self._buffers.pop(key, None)
                self._tags.pop(key, None)
                self._buffers[key] = torch.empty(sizes[key], dtype=key[1], device=key[0])
            if key[2] != LARGE_SLOT or (not expandable_segments() if pin_large is None else pin_large):
                self._pinned.add(key)
        return sum(self._buffers[key].numel() * self._buffers[key].element_size() for key in sizes)

    def slot_for(self, weight) -> str:
        """Where a fresh decode of ``weight`` goes: the large slot, or the layer slot used less recently."""
        if weight.large:
            return LARGE_SLOT
        recent = self._recent.get((weight.device, weight.dtype))
        return LAYER_SLOTS[1] if recent == LAYER_SLOTS[0] else LAYER_SLOTS[0]

    def view(self, weight, slot: str, *, for_main_stream: bool = True) -> torch.Tensor:
        """A buffer view shaped like ``weight`` in ``slot``, now tagged as holding it.

        ``for_main_stream=False`` (prefetch) does not count as a use by the main
        stream. ``self.allocated`` tells whether the call allocated a new buffer.
        """
        key = (weight.device, weight.dtype, slot)
        if slot == LARGE_SLOT:
            for listener in self.large_listeners:
                listener(weight.device)
        self._wait(key)  # a pending prefetch must finish before its buffer is reused or freed
        buffer = self._buffers.get(key)
        self.allocated = buffer is None or buffer.numel() < weight.numel
        if self.allocated:
            self._buffers.pop(key, None)  # free the old buffer before allocating the larger one
            buffer = torch.empty(weight.numel, dtype=weight.dtype, device=weight.device)
            self._buffers[key] = buffer
        self._tags[key] = (_identity(weight), weight.version)
        if for_main_stream:
            self._touch(key)
        return buffer[: weight.numel].view(weight.shape)

    def kept_view(self, weight) -> torch.Tensor | None:
        """``weight``'s own buffer, now tagged with its version, if the budget keeps it (else None).

        The first weights decoded get buffers until the device's budget is spent; offloaded
        weights (``weight.home``) never do: their point is device memory.

        Example:
            >>> from neutrain.compress import compress
            >>> from neutrain.nn import CompressedWeight
            >>> w = CompressedWeight(compress(torch.randn(8, 4).bfloat16(), steps=16))
            >>> buffers = DecodeBuffers()
            >>> buffers.keep_bytes[w.device] = 64
            >>> buffers.kept_view(w).shape, buffers.kept_nbytes()
            (torch.Size([8, 4]), 64)
        """
        entry = self._kept.get(weight)
        if entry is None:
            nbytes = weight.numel * weight.dtype.itemsize
            device = weight.device
            budget = self.keep_budget(device)
            if weight.home is not None or self._kept_bytes.get(device, 0) + nbytes > budget:
                return None
            buffer = torch.empty(weight.numel, dtype=weight.dtype, device=device)
            entry = self._kept[weight] = [buffer, None, weakref.finalize(weight, self._unkeep, device, nbytes)]
            self._kept_bytes[device] = self._kept_bytes.get(device, 0) + nbytes
        entry[1] = weight.version
        return entry[0].view(weight.shape)

    def keep_budget(self, device: torch.device) -> int:
        """Bytes of kept decodes allowed on ``device`` (:func:`default_keep_bytes` unless set)."""
        budget = self.keep_bytes.get(device)
        if budget is None:
            budget = self.keep_bytes[device] = default_keep_bytes(device)
        return budget

    def kept_nbytes(self, device: torch.device | None = None) -> int:
        """Bytes of kept decodes (on ``device``, or on all)."""
        return sum(n for d, n in self._kept_bytes.items() if device is None or d == torch.device(device))

    def _unkeep(self, device: torch.device, nbytes: int) -> None:
        self._kept_bytes[device] -= nbytes

    def cached(self, weight) -> torch.Tensor | None:
        """The buffer holding the current version of ``weight``, or None (waits for a prefetch)."""
        entry = self._kept.get(weight)
        if entry is not None and entry[1] == weight.version:
            return entry[0].view(weight.shape)
        for key, tag in self._tags.items():
            if tag == (_identity(weight), weight.version):
                if key in self._events:
                    self.prefetch_hits += 1
                    self._wait(key)
                self._touch(key)
                return self._buffers[key][: weight.numel].view(weight.shape)
        return None

    def holds(self, weight) -> bool:
        entry = self._kept.get(weight)
        return (entry is not None and entry[1] == weight.version) or \
            (_identity(weight), weight.version) in self._tags.values()

    def keeps(self, weight) -> bool:
        """Whether ``weight`` has a buffer of its own (decodes go there, never into a slot)."""
        return weight in self._kept

    def set_event(self, weight, slot: str, event) -> None:
        self._events[(weight.device, weight.dtype, slot)] = event

    def invalidate(self, weight) -> None:
        entry = self._kept.get(weight)
        if entry is not None:
            entry[1] = None
        for key, tag in list(self._tags.items()):
            if tag[0] == _identity(weight):
                del self._tags[key]

    def release_large(self, weight) -> None:
        """Free the large buffer if it holds ``weight`` or nothing (a vocab-sized matrix must not sit idle;
        nor must an empty slot reserved for one that is read by row blocks, :mod:`neutrain.nn.row_blocks`).

        A pinned (reserved) large slot stays: freeing it would only fragment the allocator.
        """
        key = (weight.device, weight.dtype, LARGE_SLOT)
        tag = self._tags.get(key)
        if key in self._buffers and (tag is None or tag[0] == _identity(weight)) and key not in self._pinned:
            self._wait(key)
            self._tags.pop(key, None)
            self._buffers.pop(key, None)

    def shared_large(self, device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The large slot's memory (at least ``numel`` elements), lent to the layer groups while no vocabulary
        matrix is decoded: pinned from now on, its tag dropped (what it held is about to be overwritten)."""
        key = (device, dtype, LARGE_SLOT)
        for listener in self.large_listeners:  # whoever held it lets go (a caller that holds it too)
            listener(device)
        self._wait(key)
        self._tags.pop(key, None)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            self._buffers.pop(key, None)
            buffer = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        if key not in self._pinned:
            self._pinned.add(key)
            self._lent.add(key)
        return buffer

    def give_back_lent(self) -> None:
        """After training: the layer groups let go of the large slots they were lent, and those are freed (the
        export and generation that follow count on the room; a later group decode lends them again)."""
        for listener in self.large_listeners:
            listener(None)
        for key in self._lent:
            self._pinned.discard(key)
            self._tags.pop(key, None)
            self._buffers.pop(key, None)
        self._lent.clear()

    def clear(self) -> None:
        """Free every buffer (e.g. before measuring memory), kept ones included."""
        for listener in self.large_listeners:
            listener(None)
        for key in list(self._events):
            self._wait(key)
        for weight in list(self._kept.keys()):
            entry = self._kept.pop(weight)
            entry[2]()  # gives the bytes back now, and never again
        self._buffers.clear()
        self._tags.clear()
        self._recent.clear()
        self._pinned.clear()
        self._lent.clear()

    def nbytes(self) -> int:
        """Bytes of the shared slots (kept decodes: :meth:`kept_nbytes`)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def released_event(self, weight, slot: str):
        """CUDA event after which the main stream no longer reads ``slot`` (None: not recorded)."""
        return self._released.get((weight.device, weight.dtype, slot))

    def _touch(self, key: tuple) -> None:
        if key[2] not in LAYER_SLOTS:
            return
        self._recent[key[:2]] = key[2]
        if key[0].type == "cuda":
            # The main stream now moves to this slot's weight: everything it enqueued so far
            # (the previous layer, the other slot's user) precedes this event, so a prefetch
            # into the other slot need only wait for it, not for the current layer's work.
            other = LAYER_SLOTS[1] if key[2] == LAYER_SLOTS[0] else LAYER_SLOTS[0]
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(key[0]))
            self._released[(*key[:2], other)] = event

    def _wait(self, key: tuple) -> None:
        event = self._events.pop(key, None)
        if event is not None:
            torch.cuda.current_stream(key[0]).wait_event(event)


DECODE_BUFFERS = DecodeBuffers()
"""The process-wide decode buffers."""
