"""Encoding through the Triton kernels, with or without a host read, and the stream's capacity.

A lossless re-encode is two kernel passes: count (code lengths per lane) and pack
(codes into the stream); after a fused LOMO update the count was done inside the update
(:mod:`neutrain.compress.counted`) and only its small finishing kernel runs here. The
stream's length depends on the data, so the old encoder read it back between the passes
(one host synchronisation per tensor, which drained the GPU queue in every layer's
backward). Here the pack pass checks on the device
whether the new stream fits the allocated capacity and commits all of the new
encoding (tails, stream, lane counts, tile table) only if it does; it records the
used length, the coded bits and an overflow flag in a small device ``status``
tensor. So:

* ``sync=False`` (training: :meth:`CompressedWeight.write_`) reads nothing back. The
  status is copied to pinned host memory asynchronously and looked at by the *next*
  encode of the same tensor, once its CUDA event has completed (``query``, never a
  wait). That lagged view drives the two decisions that used to need the host read:
  grow the stream (when the last encode left less than half its headroom free) and rebuild the code
  (when the coded exponents grew 1 % past their size at build; that re-encode is
  synchronous, rare, and also resets the capacity headroom).
* The capacity is the used length plus 1/32 (about 0.085 bit per weight), so one step
  would have to grow the exponent stream by more than ~1.5 % to overflow (the growth check
  runs at half the headroom). A tensor can start smaller (``HEADROOM_SHIFT``) and earn
  room by growing, doubled each time up to 1/32; a measurement showed why it does not
  (``HEADROOM_SHIFT``'s note). If an encode ever overflows, the tensor keeps its previous
  content, intact, its stream grows and the next look at the status raises
  :class:`StreamOverflowError` naming the tensor: an update is never dropped silently.
* ``sync=True`` (the default of ``recompress_`` for arbitrary new data, and
  ``compress``) reads the length between the passes and grows the stream first, so
  the commit always happens.
"""

from __future__ import annotations

import torch

from neutrain.compress import counted
from neutrain.compress.codec import STREAM_PAD_WORDS

REBUILD_GROWTH = 0.01
"""Rebuild the code from a fresh histogram once the exponent stream grows 1 % past its size at build."""
OVERFLOW_LOST = 2
"""Status overflow flag of a block re-encode that did not fit (:mod:`neutrain.compress.blocks`): its
tails were rewritten already, so unlike a whole encode's (flag 1) the old value is not kept."""


class StreamOverflowError(RuntimeError):
    """A re-encode without host synchronisation did not fit its stream; the tensor kept its previous value."""


HEADROOM_SHIFT = 5
"""A new stream's headroom is ``words >> HEADROOM_SHIFT`` (1/32) plus 64 words. A trial of 1/2048
(0.0014 bit per weight instead of 0.085, the in-memory size under 10.8 bits): on an H100 the GPU tests'
small models then overflowed in their first LOMO steps (a 5,955-word q_proj stream outgrew 66 words of
headroom, an lm_head of 11,863 words likewise), and each overflow loses that step's update of the tensor
(reported, not silent). Safety first: 1/32, as before; the doubling below is kept for a smaller start."""
MIN_HEADROOM_SHIFT = 5
"""The most headroom a tensor earns by growing: 1/32 (what every tensor had before headroom could grow)."""


def capacity_for(words: int, shift: int = HEADROOM_SHIFT) -> int:
    """Stream words to allocate for ``words`` used ones: ``words >> shift`` headroom plus 64 words.

    Example:
        >>> capacity_for(1 << 20), capacity_for(1 << 20, 11)  # the default 1/32, a 1/2048 start
        (1081408, 1049152)
    """
    return words + (words >> shift) + 64


def needs_growth(words: int, capacity: int, shift: int = HEADROOM_SHIFT) -> bool:
    """Whether a sync-free encode should grow the stream first: less than half its headroom (+ 32 words) left."""
    return words + (words >> (shift + 1)) + 32 > capacity


def grow(ct, words: int, earned: bool = True) -> None:
    """Move ``ct``'s first ``words`` stream words into a stream with headroom, doubled first (up to 1/32)
    when ``earned`` (the tensor outgrew the headroom it had; a stream loaded from a checkpoint has none
    yet). The copy keeps the tensor decodable even if the next encode overflows."""
    if earned:
        ct._headroom_shift = max(MIN_HEADROOM_SHIFT, ct._headroom_shift - 1)
    grown = torch.zeros(capacity_for(words, ct._headroom_shift), dtype=torch.int32, device=ct.device)
    grown[:words].copy_(ct.stream[:words])
    ct.stream = grown


class StreamStatus:
    """Device ``int64[3]`` (used words incl. padding, coded bits, overflow flag) and its lagged host view."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.tensor = torch.tensor([STREAM_PAD_WORDS, 0, 0], dtype=torch.int64, device=self.device)
        cuda = self.device.type == "cuda"
        self._host = torch.zeros(3, dtype=torch.int64, pin_memory=cuda)
        self._event = None  # the recorder while a published status is unread; False on CPU
        self._recorder = None

    def publish(self) -> None:
        """Start copying the status to the host (after a sync-free pack); no wait."""
        cuda = self.device.type == "cuda"
        self._host.copy_(self.tensor, non_blocking=cuda)
        if cuda:
            if self._recorder is None:  # one event per tensor, recorded again each time
                self._recorder = torch.cuda.Event()
            self._recorder.record(torch.cuda.current_stream(self.device))
        self._event = self._recorder if cuda else False

    @property
    def pending(self) -> bool:
        return self._event is not None

    def poll(self, wait: bool) -> tuple[int, int, int] | None:
        """(words, coded bits, overflow) of the last published encode, or None if not there yet (``wait=False``)."""
        if self._event is None:
            return None
        if self._event is not False and not self._event.query():  # False: a CPU copy, done already
            if not wait:
                return None
            self._event.synchronize()
        self._event = None
        words, coded, overflow = self._host.tolist()
        return words, coded, overflow


def publish_many(statuses: list[StreamStatus]) -> None:
    """:meth:`StreamStatus.publish` for the statuses of one grouped encode: their copies, then one event they
    share (an event recorded per tensor cost as much host time as a grouped encode's launches)."""
    if not statuses:
        return
    device = statuses[0].device
    cuda = device.type == "cuda"
    for status in statuses:
        status._host.copy_(status.tensor, non_blocking=cuda)
    event = False
    if cuda:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
    for status in statuses:
        status._event = event


def kernel_scratch(ct) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lane counts ``uint8[tiles * lanes]``, tile words/bits ``int64[2, tiles]``, their prefix sums)."""
    scratch = getattr(ct, "_scratch", None)
    if scratch is None:
        device = ct.device
        scratch = (torch.zeros(ct.tiles * ct.lanes, dtype=torch.uint8, device=device),
                   torch.zeros(2, ct.tiles, dtype=torch.int64, device=device),
                   torch.zeros(2, ct.tiles, dtype=torch.int64, device=device))
        ct._scratch = scratch
    return scratch


def _count(ct, x: torch.Tensor):
    from neutrain.kernels import codec as kcodec  # lazy: Triton, GPU path only

    counts, scratch, cum = kernel_scratch(ct)
    kcodec.count_lossless(x, ct.enc_table, counts, scratch, ct.steps, ct.lanes, ct.elems, cum=cum)
    return counts, cum


def _finish(ct, lane_bits: torch.Tensor):
    from neutrain.kernels import codec as kcodec  # lazy: Triton, GPU path only

    counts, scratch, cum = kernel_scratch(ct)
    kcodec.finish_count(lane_bits, counts, scratch, cum, ct.lanes)
    return counts, cum


def _pack(ct, x: torch.Tensor, counts: torch.Tensor, cum: torch.Tensor) -> None:
    from neutrain.kernels import codec as kcodec  # lazy: Triton, GPU path only

    kcodec.pack_lossless(x, ct.enc_table, counts, cum, ct.stream.numel(), ct.stream, ct.tails, ct.lane_words,
                         ct.tile_base, ct.status.tensor, ct.steps, ct.lanes, ct.elems)


def _total(cum: torch.Tensor) -> tuple[int, int]:
    words, coded = cum[:, -1].tolist()
    return words + STREAM_PAD_WORDS, coded


def settle(ct, wait: bool) -> None:
    """Take in the lagged status of ``ct``'s last sync-free encode, if it is there (or ``wait``)."""
    seen = ct.status.poll(wait)
    if seen is None:
        return
    words, coded, overflow = seen
    if overflow:
        ct.status.tensor[2].zero_()  # the flag is sticky on the device until seen here
        if overflow == OVERFLOW_LOST:
            raise StreamOverflowError(
                f"compressed tensor {ct.name or '<unnamed>'!r}: a block-by-block re-encode needed more than the "
                f"{ct.stream.numel()} stream words allocated; its value is lost (restore it from a checkpoint).")
        capacity = ct.stream.numel()
        grow(ct, words)  # the tensor kept its last committed stream: status[0] still holds its length
        raise StreamOverflowError(
            f"compressed tensor {ct.name or '<unnamed>'!r}: a re-encode without host synchronisation needed more "
            f"than the {capacity} stream words allocated, so that update was not stored (the tensor keeps "
            f"its previous value; its stream now has {ct.stream.numel()} words). Re-encode with "
            "recompress_(..., sync=True) to store it."
        )
    ct._words, ct._coded_seen = words, coded


def prepare_sync_free(ct, fresh_code: bool = False) -> bool:
    """Before a sync-free encode of ``ct``: take in the lagged status and grow the stream if it
    ran short. False if this encode must be synchronous instead (a fresh code, or the code is due
    for a rebuild)."""
    settle(ct, wait=False)
    if fresh_code or ct._coded_seen > (1 + REBUILD_GROWTH) * ct._coded_bits_at_build:
        return False  # rebuild the code: a histogram on the host anyway
    if not ct.status.pending and needs_growth(ct._words, ct.stream.numel(), ct._headroom_shift):
        grow(ct, ct._words, earned=ct.stream.numel() > ct._words)
    return True


def encode_lossless(ct, x: torch.Tensor, fresh_code: bool, sync: bool) -> None:
    """Encode contiguous bf16 ``x`` into ``ct`` through the kernels (see the module docstring)."""
    if ct.tiles == 0:
        ct._words, ct._coded_seen = STREAM_PAD_WORDS, 0
        if fresh_code:
            ct._coded_bits_at_build = 1
        return
    if not sync:
        sync = not prepare_sync_free(ct, fresh_code)
    lane_bits = counted.take(ct, x)  # pass 1 already done inside the fused update, if it was
    if not sync:
        counts, cum = _count(ct, x) if lane_bits is None else _finish(ct, lane_bits)
        _pack(ct, x, counts, cum)
        ct.status.publish()
        return
    if lane_bits is not None:
        counted.discard(lane_bits)  # this path counts again (and may rebuild the code)
    settle(ct, wait=True)
    counts, cum = _count(ct, x)
    words, coded = _total(cum)  # the host read
    if not fresh_code and coded > (1 + REBUILD_GROWTH) * ct._coded_bits_at_build:
        ct._rebuild_code(x)  # weights drifted: the old code still encodes everything (escapes), but worse
        counts, cum = _count(ct, x)
        words, coded = _total(cum)
        fresh_code = True
    if fresh_code:
        ct._coded_bits_at_build = max(coded, 1)
    if words > ct.stream.numel():
        ct.stream = torch.zeros(capacity_for(words, ct._headroom_shift), dtype=torch.int32, device=ct.device)
    _pack(ct, x, counts, cum)
    ct._words, ct._coded_seen = words, coded


def encode_lossy(ct, x: torch.Tensor, fresh_code: bool) -> None:
    """Lossy bf16 through the kernels: tails pack across lanes in pass 1, so this path always reads the length."""
    from neutrain.kernels import codec_lossy as kcodec  # lazy: Triton, GPU path only

    _, scratch, _ = kernel_scratch(ct)
    tile_words, tile_bits = scratch

    def count():
        kcodec.count(x, ct.enc_table, ct.tails, ct.lane_words, tile_words, tile_bits, ct.steps, ct.lanes,
                     ct.layout.kept)
        torch.cumsum(tile_words, dim=0, out=ct.tile_base[1:])
        return torch.stack([ct.tile_base[-1] + STREAM_PAD_WORDS, tile_bits.sum()]).tolist()

    words, coded = count()
    if not fresh_code and coded > (1 + REBUILD_GROWTH) * ct._coded_bits_at_build:
        ct._rebuild_code(x)
        words, coded = count()
        fresh_code = True
    if fresh_code:
        ct._coded_bits_at_build = max(coded, 1)
    if words > ct.stream.numel():
        ct.stream = torch.zeros(capacity_for(words, ct._headroom_shift), dtype=torch.int32, device=ct.device)
    ct.stream[words - STREAM_PAD_WORDS: words].zero_()
    kcodec.pack(x, ct.enc_table, ct.lane_words, ct.tile_base, ct.stream, ct.steps, ct.lanes, ct.layout.kept)
    ct._words, ct._coded_seen = words, coded
