"""Where each tensor of a model file lies: inside the data section, its bytes its own, its size its shape's.

Why: a model file's header says where each tensor's bytes are, and the readers (``gguf``'s memory map,
safetensors' Rust loader) believe it. A GGUF file whose ``blk.1.ffn_up`` offset equalled ``blk.1.ffn_gate``'s
loaded, generated, and exited 0: two weights read the same bytes and nothing said so. Both formats'
header walks (:mod:`neutrain.storage.gguf_header`, :func:`neutrain.storage.manifest.safetensors_header`) hand
their tensors' byte ranges to :func:`check_ranges`, which refuses the first range that leaves the data
section or shares a byte with another, in one line naming the file and both tensors.

Example:
    >>> check_ranges("GGUF file 'm.gguf'", [("a", 0, 64), ("b", 32, 96)], 128, ValueError)
    Traceback (most recent call last):
    ValueError: GGUF file 'm.gguf': tensors 'b' and 'a' share bytes (data bytes 32..96 and 0..64); each tensor must have bytes of its own
"""

from __future__ import annotations

import math
import os
import struct
from typing import Any, Iterable

from neutrain.errors import CheckpointError
from neutrain.files import check_kind, parse_json


def check_ranges(label: str, ranges: Iterable[tuple[str, int, int]], data_size: int, error: type[Exception]) -> None:
    """Refuse a tensor whose ``[begin, end)`` byte range (relative to the data section) is empty-negative, ends
    past ``data_size``, or overlaps another tensor's.

    Args:
        label: Names the file, first in the message.
        ranges: ``(tensor name, begin, end)`` per tensor.
        data_size: Bytes in the data section.
        error: The error class raised (the callers': ``CheckpointError``).
    """
    ordered = sorted(ranges, key=lambda r: (r[1], r[2]))
    previous: tuple[str, int, int] | None = None
    for name, begin, end in ordered:
        if begin < 0 or end < begin:
            raise error(f"{label}: tensor '{name}' has the byte range {begin:,}..{end:,}, which is no range")
        if end > data_size:
            raise error(f"{label}: tensor '{name}' ends at data byte {end:,}, past the end of the data section "
                        f"({data_size:,} bytes): truncated or corrupt")
        if previous is not None and begin < previous[2] and end > begin:
            raise error(f"{label}: tensors '{name}' and '{previous[0]}' share bytes (data bytes {begin:,}..{end:,} and "
                        f"{previous[1]:,}..{previous[2]:,}); each tensor must have bytes of its own")
        if previous is None or end > previous[2]:
            previous = (name, begin, end)


# Bits per element of each dtype the safetensors format names (its Rust reader refuses any other name).
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8,
              "F8_E5M2FNUZ": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
              "I32": 32, "U32": 32, "F32": 32, "C64": 64, "I64": 64, "U64": 64, "F64": 64}
MAX_SAFETENSORS_HEADER = 100_000_000
"""The safetensors library's own bound on a header's bytes; a claim past it is refused before any is read."""
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


def _whole(value: Any) -> bool:
    """A whole number the format's 64-bit sizes hold (the library refuses``2**70``, which Python multiplies)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63


def safetensors_header(path: str | os.PathLike, error: type[Exception] = CheckpointError) -> tuple[int, dict]:
    """``(data start, header)`` of a safetensors file, its header held to the format as the library reads it, in one
    line naming the file (and the tensor) where it is not.

    Checked: the header's length within the file and within :data:`MAX_SAFETENSORS_HEADER` (a length of 20 GB was
    read into memory whole); its JSON (UTF-8, an object, no key twice: Python kept the last of two tensors of one
    name, no ``NaN``/``Infinity``: ``int(inf)`` was an ``OverflowError`` traceback); ``__metadata__`` a mapping of
    text to text; each tensor's entry a mapping of a known dtype, a shape of whole numbers >= 0 (``-2`` times ``-2``
    matched 16 bytes, ``4.9`` and ``"4"`` passed through ``int()``) and two whole offsets, its bytes its shape's;
    then the tensors cover the data section end to end without sharing a byte (:func:`check_ranges`).

    Example:
        >>> import tempfile, struct
        >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
        >>> head = b'{"w": {"dtype": "F32", "shape": [-1, -1], "data_offsets": [0, 4]}}'
        >>> _ = open(path, "wb").write(struct.pack("<Q", len(head)) + head + bytes(4))
        >>> safetensors_header(path, ValueError)
        Traceback (most recent call last):
        ValueError: checkpoint file '...m.safetensors': tensor 'w' has the shape [-1, -1]; expected a list of whole numbers from 0 to 2^63-1
    """
    label = f"checkpoint file '{path}'"
    size = check_kind(path, label, error).st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise error(f"{label} is empty or truncated ({size} bytes): not a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise error(f"{label} is truncated: its safetensors header needs {length} bytes, the file has {size - 8}")
        if length > MAX_SAFETENSORS_HEADER:
            raise error(f"{label}: its safetensors header claims {length:,} bytes, more than the format's bound of "
                        f"{MAX_SAFETENSORS_HEADER:,}: not a safetensors file")
        raw = fh.read(length)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"{label} is not a safetensors file (its header is not JSON)") from None
    header = parse_json(text, f"{label}: its safetensors header", error)
    if not isinstance(header, dict):
        raise error(f"{label} is not a safetensors file (its header is a JSON {type(header).__name__}, not an object)")
    metadata = header.get("__metadata__")
    if metadata is not None and not (isinstance(metadata, dict) and
                                     all(isinstance(v, str) for v in metadata.values())):
        raise error(f"{label}: its __metadata__ is {shown(metadata)}; expected a mapping of text to text")
    data = size - 8 - length
    ranges = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{label}: tensor '{name}'"
        if not isinstance(info, dict) or not _ENTRY_KEYS <= set(info):
            raise error(f"{where} has a malformed header entry ({shown(info)}); expected dtype, shape and data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
            raise error(f"{where} has the dtype {shown(dtype)}, which safetensors does not name")
        if not isinstance(shape, list) or not all(_whole(d) for d in shape):
            raise error(f"{where} has the shape {shown(shape)}; expected a list of whole numbers from 0 to 2^63-1")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_whole(o) for o in offsets)):
            raise error(f"{where} has the data_offsets {shown(offsets)}; expected two whole numbers from 0 to 2^63-1")
        begin, stop = offsets
        bits = math.prod(shape) * DTYPE_BITS[dtype]
        if stop < begin or (stop - begin) * 8 != bits + (-bits % 8):
            raise error(f"{where} has inconsistent offsets {begin}..{stop} for its {dtype} shape {shape} "
                        f"({(bits + 7) // 8:,} bytes)")
        if stop > data:
            raise error(f"{label} is truncated: tensor '{name}' ends at byte {stop} of {data} data bytes")
        ranges.append((name, begin, stop))
    check_ranges(label, ranges, data, error)  # inside the data section, no two tensors share bytes
    end = max((stop for _, _, stop in ranges), default=0)
    if end != data:
        raise error(f"{label}: {data - end} bytes after the last tensor (corrupt or appended)")
    return 8 + length, header


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
