"""Serving from the zgemv layout alone: each covered weight's NeuZip payload freed, restored exactly on demand.

:func:`~neutrain.decode.zgemv.attach_zgemv` keeps the 12-bit zgemv layouts beside the NeuZip payloads (about
10.9 + 12 bits a weight, more than bf16's 16). With ``release=True`` the layout *replaces* the payload:
:func:`release` swaps each covered :class:`~neutrain.nn.weight.CompressedWeight`'s compressed tensor for a
:class:`ZgemvStandIn` and frees the tensor's buffers (stream, lane counts, tile table, tails, encoder scratch),
so the model holds about 12 bits a weight plus each tensor's code tables (a few KiB).

What reads the weight then:

* decode steps (at most 8 rows, no autograd) run ``zgemv`` on the layout, as without release;
* every other product (a prefill, a call with autograd) decodes the weight, through the stand-in, into the buffer
  the compressed path decodes into (the shared decode slots, a fused group's scratch matrix): bf16 from the
  layout (:meth:`~neutrain.compress.zgemv.ZgemvWeight.decode_into`), never a copy of the whole model;
* saving (``state_dict``, checkpoints, export through ``saved_ct``) gets the exact payload rebuilt for the
  save, one weight at a time, the payload staying released;
* anything that needs the payload itself (:attr:`CompressedWeight.ct`: an optimizer's write, row-block updates,
  LoRA's checks) restores it for good; :func:`restore` (called by ``detach_zgemv``) restores them all.

Exactness: at release the tensor's checksum (the one its state dict carries, over every saved blob and the
header) is kept with its code (the Huffman code lengths and tables, geometry, coded-bit counters, stream
capacity). A restore encodes the layout's exact bf16 with that same code, which is deterministic, so it writes
the same bytes; the checksum is compared and a mismatch raises (the layout still holds the weight, nothing is
lost). Weights offloaded to host memory or decoded with a layer group (training features) keep their payloads.

A CUDA graph captured before the release that decodes a payload would read freed memory: release before an
engine captures (``DecodeEngine(..., zgemv="replace")`` does), as an engine is remade after training anyway.
"""

from __future__ import annotations

import copy

import torch

from neutrain.compress import stream as kstream
from neutrain.compress.codec import STREAM_PAD_WORDS
from neutrain.compress.layout import tails_capacity
from neutrain.compress.zgemv import ZgemvWeight
from neutrain.nn.buffers import DECODE_BUFFERS
from neutrain.nn.weight import CompressedWeight, PayloadStandIn

_PAYLOAD = ("stream", "lane_words", "tile_base", "tails")


class ZgemvStandIn(PayloadStandIn):
    """Rows ``start : start + shape[0]`` of a zgemv layout standing in for a released compressed tensor."""

    def __init__(self, ct, zw: ZgemvWeight, start: int):
        kstream.settle(ct, wait=True)  # the last sync-free encode's length and coded bits, into the header
        self.checksum = ct.state_dict()["checksum"].clone()
        self.shape, self.dtype, self.device, self.name = ct.shape, ct.dtype, ct.device, ct.name
        self.zw, self.start = zw, start
        self.escapes = zw.escape_span(start, start + ct.shape[0])
        self.capacity = ct.stream.numel()
        self.code = copy.copy(ct)  # the code and counters; its buffers are dropped below
        for name in _PAYLOAD:
            setattr(self.code, name, None)
        self.code._scratch = self.code._pending_symbols = None

    @property
    def nbytes(self) -> int:
        """Bytes this weight holds on its own: the code tables (the layout is counted with its matrix)."""
        code = self.code
        return code.enc_table.numel() * code.enc_table.element_size() + \
            code.lut.numel() * code.lut.element_size() + code.code_lengths.size

    def __repr__(self) -> str:
        return f"ZgemvStandIn(shape={tuple(self.shape)}, dtype={self.dtype}, released payload, device={self.device})"

    def decompress(self, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self.zw.decode_into(out, self.start, self.escapes)

    def decompress_rows(self, index: torch.Tensor) -> torch.Tensor:
        if self.start or self.shape[0] != self.zw.shape[0]:
            index = torch.as_tensor(index, device=self.device) + self.start
        return self.zw.decode_rows(index)

    def restore(self):
        """The compressed tensor rebuilt with its own code from the layout's exact bf16, checked by its checksum."""
        ct = copy.copy(self.code)
        device, numel = self.device, self.shape.numel()
        ct.stream = torch.zeros(max(self.capacity, STREAM_PAD_WORDS), dtype=torch.int32, device=device)
        ct.lane_words = torch.zeros(ct.tiles * ct.lanes, dtype=torch.uint8, device=device)
        ct.tile_base = torch.zeros(ct.tiles + 1, dtype=torch.int64, device=device)
        ct.tails = torch.zeros(tails_capacity(numel, ct.layout.tail_bits), dtype=torch.uint8, device=device)
        ct.status = kstream.StreamStatus(device)
        built = ct._coded_bits_at_build
        ct._coded_bits_at_build = float("inf")  # the same code: a re-encode of these values never rebuilds it
        try:
            ct._encode(self.decompress(), "auto", fresh_code=False, sync=True)
        finally:
            ct._coded_bits_at_build = built
        if not torch.equal(ct.state_dict()["checksum"], self.checksum):
            raise RuntimeError(f"compressed weight {self.name or '<unnamed>'!r}: the payload rebuilt from its zgemv "
                               "layout differs from the released one (checksum); the layout still serves it")
        return ct


def release(weights: list[CompressedWeight], zw: ZgemvWeight, kept: set[int] = frozenset()) -> list[CompressedWeight]:
    """Replace the payloads of ``weights`` (row blocks of ``zw``, in order, which must have been converted from
    their current versions: :func:`~neutrain.decode.zgemv.attach_zgemv` calls this right after the conversion) by
    stand-ins; returns those released. A weight already released, offloaded, in a layer group, of a dtype or
    device other than the layout's, or whose ``id`` is in ``kept`` keeps its payload."""
    done, start = [], 0
    for weight in weights:
        if not (id(weight) in kept or weight.released or weight.home is not None or weight.group is not None
                or weight.dtype != torch.bfloat16 or weight.device != zw.device):
            weight._ct = ZgemvStandIn(weight.ct, zw, start)
            DECODE_BUFFERS.invalidate(weight)
            done.append(weight)
        start += weight.shape[0]
    return done


def restore(weights: list[CompressedWeight]) -> int:
    """Give each released weight of ``weights`` its exact payload back; returns how many were restored."""
    count = 0
    for weight in weights:
        if weight.released:
            weight.ct  # noqa: B018 -- the property restores and keeps it
            count += 1
    return count


def payload_bytes(weights: list[CompressedWeight]) -> int:
    """Bytes the weights' compressed tensors (or stand-ins) hold, each weight once."""
    return sum(w.nbytes for w in {id(w): w for w in weights}.values())
