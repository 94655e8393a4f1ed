"""The encode's first pass counted inside the fused update, so the re-encode reads the weight once.

A lossless re-encode is two passes over the new weight (:mod:`neutrain.compress.stream`):
count (each lane's code lengths, hence where every lane's bits go) and pack. The fused
LOMO update (:func:`neutrain.kernels.fused_update.fused_update_`) has every updated
value in registers just before it stores it, so it can add that value's code length to
its lane's count: the encode then skips its count pass and reads the weight once (3.35
instead of 5.35 bytes per weight; benchmarks/codec/NOTES.md). The counts are integer
sums, so they are the count pass's, bit for bit, and so are the encoded bytes.

Protocol, one weight at a time on the device's stream (the fused optimizer's order):

1. :func:`begin` (the update, before its kernels): the code table, the shared lane-count
   buffer (zero) and the geometry, or None when the re-encode will not take the
   counted path (not lossless bf16 through the Triton codec, or an empty tensor).
2. the update's kernels add every element's code length, once each.
3. :func:`take` (the re-encode of that same tensor): the buffer if the counts are for
   this tensor and these values, else None; the sync-free encode turns it into the count
   pass's outputs and zeroes it (:func:`neutrain.kernels.codec.finish_count`), any other
   path calls :func:`discard`.

Anything that breaks the sequence (an exception between the update and the encode, a
write of other values) leaves a pending count that the next :func:`begin` or
:func:`take` zeroes before use: a stale count never reaches an encode.
"""

from __future__ import annotations

import torch

IN_UPDATE = False
"""Whether compressed weights ask the fused LOMO update to count (``CompressedWeight.count_into``).
Off: measured on an H100 (Llama-3-8B gate/up, 58.7M weights, ``benchmarks/codec/codec.py --encode-host``)
the update's per-element table load and lane atomics cost more than the count pass they
save: update + counted encode 0.399 ms against update + two-pass encode 0.371 ms. The path stays
bit-exact and tested; set it True to use it (e.g. on a card where the count pass is dearer)."""

_BUFFERS: dict = {}  # device -> int32 lane counts, grown to the largest tensor, zero between uses
_PENDING: dict = {}  # device -> (tensor, data_ptr, version) counted but not yet encoded


def _buffer(device: torch.device, lanes: int) -> torch.Tensor:
    buffer = _BUFFERS.get(device)
    if buffer is None or buffer.numel() < lanes:
        buffer = torch.zeros(lanes, dtype=torch.int32, device=device)
        _BUFFERS[device] = buffer
    return buffer[:lanes]


def _clear_stale(device: torch.device) -> None:
    stale = _PENDING.pop(device, None)
    if stale is not None:
        _buffer(device, stale[0].tiles * stale[0].lanes).zero_()


def begin(ct, weight: torch.Tensor, backend: str = "auto"):
    """``(enc_table, lane_bits, (steps, lanes, elems))`` for counting ``weight``'s new values into ``ct``
    during its update, or None if the re-encode would not use the counts.

    Example (on a GPU; ``ct`` lossless bf16, ``w`` its decoded weight, ``g`` a gradient):
        >>> count = begin(ct, w)                                               # doctest: +SKIP
        >>> fused_update_(w, g, lr=1e-3, ok=ok, count=count)                   # doctest: +SKIP
        >>> ct.recompress_(w, sync=False)  # takes the counts: one pass         # doctest: +SKIP
    """
    if not (ct.tiles and ct.encodes_lossless_kernels(backend)):
        return None
    if weight.device != ct.device or weight.dtype != ct.dtype or weight.numel() != ct.numel:
        return None
    _clear_stale(ct.device)
    _PENDING[ct.device] = (ct, weight.data_ptr(), weight._version)
    return ct.enc_table, _buffer(ct.device, ct.tiles * ct.lanes), (ct.steps, ct.lanes, ct.elems)


def take(ct, x: torch.Tensor) -> torch.Tensor | None:
    """The lane counts of ``x`` if :func:`begin` was called for ``ct`` and these very values, else None.

    ``x`` must be the tensor the update wrote (same storage, nothing written to it since the
    update's kernels: torch's version counter tells, as the update writes through Triton).
    """
    pending = _PENDING.get(x.device)
    if pending is None:
        return None
    if pending != (ct, x.data_ptr(), x._version):
        _clear_stale(x.device)
        return None
    del _PENDING[x.device]
    return _buffer(x.device, ct.tiles * ct.lanes)


def discard(lane_bits: torch.Tensor) -> None:
    """Counts taken but not used (the encode went synchronous): zero them for the next update."""
    lane_bits.zero_()
