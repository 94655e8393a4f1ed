"""On-disk form of a compressed tensor: plain tensors, a header and a checksum.

A state dict holds only plain tensors, so safetensors (or ``torch.save``) can
store it next to ordinary weights:

============== ========================= =============================================
key            dtype / shape             content
============== ========================= =============================================
``header``     int64[10 + ndim]          version, dtype code, kept mantissa bits (-1:
                                         lossless), steps, lanes, elems, numel, coded
                                         exponent bits when the code was built and
                                         coded exponent bits of this encoding (what
                                         decides the next rebuild, so a resumed run
                                         rebuilds exactly when the original would),
                                         ndim, shape
``code_lengths`` uint8[258]              Huffman lengths (0: escaped), escape last
``lane_words`` uint8[tiles * lanes]      words per lane
``tile_base``  int64[tiles + 1]          word prefix sums per tile
``stream``     int32[words + 3]          lane bitstreams (+ three zero words)
``tails``      uint8[...]                packed sign and mantissa bits
``checksum``   int64[2]                  :func:`~neutrain.compress.checksum.checksum`
                                         of the six blobs above, in that order
``name``       uint8[...]                UTF-8 name, for error messages (not hashed)
============== ========================= =============================================

Loading verifies the checksum first, then every size, so a corrupted blob
raises :class:`CorruptTensorError` naming the tensor instead of decoding garbage.

Version 1 headers (``int64[9 + ndim]``) have no coded bits of the encoding; they load
with the coded bits at build in their place, as before.
"""

from __future__ import annotations

import numpy as np
import torch

from neutrain.compress.checksum import checksum
from neutrain.compress.codec import STREAM_PAD_WORDS, num_tiles
from neutrain.compress.huffman import ESCAPE, MAX_CODE_BITS, NUM_SYMBOLS
from neutrain.compress.layout import DTYPE_CODES, DTYPES_BY_CODE, Layout, layout_for, tail_nbytes

FORMAT_VERSION = 2
_FIXED = {1: 9, 2: 10}  # header fields before the shape, per version
BLOB_KEYS = ("header", "code_lengths", "lane_words", "tile_base", "stream", "tails")


class CorruptTensorError(ValueError):
    """A stored compressed tensor failed its checksum or a consistency check."""


def make_header(layout: Layout, shape: torch.Size, steps: int, lanes: int, elems: int,
                coded_bits_at_build: int, coded_bits: int) -> torch.Tensor:
    """The ``int64`` header tensor (``coded_bits``: the coded exponent bits of the stored encoding)."""
    kept = -1 if layout.lossless else layout.kept
    numel = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    values = [FORMAT_VERSION, DTYPE_CODES[layout.dtype], kept, steps, lanes, elems, numel, int(coded_bits_at_build),
              int(coded_bits), len(shape), *shape]
    return torch.tensor(values, dtype=torch.int64)


def encode_name(name: str | None) -> torch.Tensor:
    return torch.tensor(list((name or "").encode("utf-8")), dtype=torch.uint8)


def decode_name(blob: torch.Tensor | None) -> str | None:
    if blob is None or blob.numel() == 0:
        return None
    return bytes(blob.cpu().tolist()).decode("utf-8", errors="replace")


def seal(blobs: dict[str, torch.Tensor], name: str | None) -> dict[str, torch.Tensor]:
    """The blobs plus their checksum and the name: a complete state dict."""
    out = dict(blobs)
    out["checksum"] = checksum(blobs[key] for key in BLOB_KEYS)
    out["name"] = encode_name(name)
    return out


def open_sealed(state: dict[str, torch.Tensor], name: str | None = None):
    """Verify a state dict and parse its header.

    Returns:
        ``(label, layout, shape, (steps, lanes, elems), code_lengths, (coded_bits_at_build, coded_bits))``.

    Raises:
        CorruptTensorError: missing keys, checksum mismatch or inconsistent sizes,
            with the tensor's name in the message.
    """
    label = name or decode_name(state.get("name")) or "<unnamed>"

    def fail(reason: str) -> CorruptTensorError:
        return CorruptTensorError(f"compressed tensor {label!r} is corrupt: {reason}")

    missing = [key for key in (*BLOB_KEYS, "checksum") if key not in state]
    if missing:
        raise fail(f"missing entries {missing}")
    stored = state["checksum"].detach().cpu().to(torch.int64).reshape(-1)
    if stored.numel() != 2 or not torch.equal(stored, checksum(state[key] for key in BLOB_KEYS)):
        raise fail("checksum mismatch (a stored byte changed after saving)")
    header = state["header"].cpu().tolist()
    fixed = _FIXED.get(header[0] if header else None)
    if fixed is None or len(header) < fixed:
        raise fail(f"unknown header {header[:10]}")
    _, dtype_code, kept, steps, lanes, elems, numel, coded_bits_at_build = header[:8]
    coded_bits = header[8] if fixed == 10 else coded_bits_at_build  # version 1: the reference in its place
    ndim, shape = header[fixed - 1], torch.Size(header[fixed:])
    if dtype_code not in DTYPES_BY_CODE or len(shape) != ndim or (int(np.prod(shape)) if ndim else 1) != numel \
            or coded_bits < 0:
        raise fail(f"bad header {header}")
    layout = layout_for(DTYPES_BY_CODE[dtype_code], None if kept < 0 else kept)
    per_byte = 8 // layout.tail_bits if layout.tail_bits < 8 else 1
    if steps < 1 or lanes < per_byte or lanes & (lanes - 1) or elems < 1 or elems & (elems - 1) or \
            coded_bits_at_build < 1:
        raise fail(f"bad tile geometry steps={steps} lanes={lanes}")
    tiles = num_tiles(numel, steps, lanes, elems)
    lengths = state["code_lengths"].cpu().numpy().astype(np.int64)
    if lengths.shape != (NUM_SYMBOLS + 1,) or lengths.max() > MAX_CODE_BITS or lengths[ESCAPE] == 0:
        raise fail("bad code lengths")
    coded = lengths[lengths > 0]
    if (2.0 ** -coded.astype(np.float64)).sum() > 1.0:
        raise fail("code lengths violate the Kraft inequality")
    expected = {
        "lane_words": tiles * lanes,
        "tile_base": tiles + 1,
        "tails": tail_nbytes(numel, layout.tail_bits),
    }
    for key, size in expected.items():
        if state[key].numel() != size:
            raise fail(f"{key} has {state[key].numel()} elements, expected {size}")
    tile_base = state["tile_base"]
    words = int(tile_base[-1])
    if int(tile_base[0]) != 0 or state["stream"].numel() < words + STREAM_PAD_WORDS:
        raise fail("stream shorter than its tile table")
    lane_totals = state["lane_words"].view(tiles, lanes).to(torch.int64).sum(dim=1)
    if not torch.equal(lane_totals.cpu(), (tile_base[1:] - tile_base[:-1]).cpu()):
        raise fail("lane word counts disagree with the tile table")
    return label, layout, shape, (steps, lanes, elems), lengths.astype(np.uint8), (coded_bits_at_build, coded_bits)
