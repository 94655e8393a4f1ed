"""A GGUF file's header, checked against the file's size before any reader trusts its counts.

Why: a truncated GGUF file, or one whose header lies (a tensor count of 2^40, a string length past
the end), ended in a ``struct.error`` traceback from the ``gguf`` reader, and a lying count could
make a reader allocate for it. :func:`check_gguf_file` walks the header (version, key-value
metadata, tensor descriptions) with every length bounded by the bytes that remain, and refuses the
first thing that does not fit in one line naming the file. Only the header is read.

Then the tensors' layout: the data section starts at the header's end rounded up to
``general.alignment`` (32 by default); each tensor's byte count follows from its type (block size and
bytes per block) and shape, its first dimension must be a whole number of blocks, its offset a multiple of
the alignment, and its bytes must lie inside the data section and belong to no other tensor
(:func:`neutrain.storage.tensor_layout.check_ranges`): two tensors whose offsets point at the same bytes
loaded, and generated, without a word.

The layout (GGUF v2 and v3, little-endian): ``GGUF``, version u32, tensor count u64, metadata count
u64, the metadata (key string, value type u32, value), then per tensor: name string, dimension count
u32, dimensions u64 each, type u32, data offset u64. A string is a u64 length and its bytes.

Example:
    >>> import tempfile, struct, os
    >>> path = os.path.join(tempfile.mkdtemp(), "cut.gguf")
    >>> _ = open(path, "wb").write(b"GGUF" + struct.pack("<I", 3) + b"\\x01")
    >>> try:
    ...     check_gguf_file(path)
    ... except CheckpointError as exc:
    ...     print(str(exc).split(":")[1].strip())
    truncated or corrupt
"""

from __future__ import annotations

import os
import struct

from neutrain.errors import CheckpointError
from neutrain.storage.tensor_layout import check_ranges

_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
_STRING, _ARRAY, _U32 = 8, 9, 4
_MAX_DIMS = 8
_ALIGNMENT_KEY = b"general.alignment"
# ggml tensor type -> (elements per block, bytes per block), as gguf.constants.GGML_QUANT_SIZES has them.
GGML_BLOCKS = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40),
               10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
               16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82),
               23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2),
               34: (256, 54), 35: (256, 66), 39: (32, 17), 40: (64, 36), 41: (128, 18)}


class _Short(Exception):
    """The header needs more bytes than the file has left (the message says for what)."""


class _Header:
    def __init__(self, fh, size: int):
        self.fh, self.size, self.pos = fh, size, 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise _Short(f"{what} needs {n:,} bytes at byte {self.pos:,}, past the end of the file ({self.size:,} bytes)")
        self.fh.seek(self.pos)
        data = self.fh.read(n)
        self.pos += n
        return data

    def skip(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Short(f"{what} needs {n:,} bytes at byte {self.pos:,}, past the end of the file ({self.size:,} bytes)")
        self.pos += n

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack("<Q", self.take(8, what))[0]

    def string(self, what: str) -> None:
        self.skip(self.u64(f"the length of {what}"), what)

    def text(self, what: str, longest: int = 1 << 16) -> bytes:
        n = self.u64(f"the length of {what}")
        if n > self.size - self.pos:
            self.take(n, what)  # says it runs past the end of the file
        if n > longest:
            raise _Short(f"{what} is {n:,} bytes long (at most {longest:,})")
        return self.take(n, what)

    def value(self, kind: int, what: str, depth: int = 0) -> None:
        if kind in _SCALARS:
            self.skip(_SCALARS[kind], what)
        elif kind == _STRING:
            self.string(what)
        elif kind == _ARRAY and depth == 0:
            inner, count = self.u32(f"the element type of {what}"), self.u64(f"the length of {what}")
            if inner in _SCALARS:
                self.skip(_SCALARS[inner] * count, f"{what} ({count:,} elements)")
            else:
                for i in range(count):  # each element takes at least 8 bytes: the loop ends with the file
                    self.value(inner, f"element {i} of {what}", depth + 1)
        else:
            raise _Short(f"{what} has the unknown value type {kind}")


def check_gguf_file(path: str | os.PathLike) -> None:
    """Refuse a GGUF file whose header is truncated, of an unknown version, or claims more than the file holds.

    Raises:
        CheckpointError: one line naming the file and the first part of the header that does not fit.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        header = _Header(fh, size)
        try:
            if header.take(4, "the magic number") != b"GGUF":
                raise CheckpointError(f"'{path}' is not a GGUF file (it does not start with 'GGUF')")
            version = header.u32("the version")
            if version not in (2, 3):
                raise CheckpointError(f"'{path}' is GGUF version {version}; neutrain reads versions 2 and 3")
            tensors, entries = header.u64("the tensor count"), header.u64("the metadata count")
            alignment = 32
            for i in range(entries):
                key = header.text(f"metadata key {i}")
                kind = header.u32(f"the value type of metadata {i}")
                if key == _ALIGNMENT_KEY and kind == _U32:
                    alignment = header.u32(f"metadata value {i}")
                else:
                    header.value(kind, f"metadata value {i}")
            if alignment < 1 or alignment & (alignment - 1):
                raise CheckpointError(f"GGUF file '{path}': general.alignment is {alignment}, not a power of two")
            layout = [_tensor(header, i) for i in range(tensors)]
        except _Short as exc:
            raise CheckpointError(f"GGUF file '{path}': truncated or corrupt: {exc}") from None
    start = -(-header.pos // alignment) * alignment
    check_layout(f"GGUF file '{path}'", layout, alignment, max(size - start, 0))


def _tensor(header: _Header, i: int) -> tuple[str, list[int], int, int]:
    """``(name, dimensions, ggml type, data offset)`` of the ``i``-th tensor description."""
    raw = header.text(f"the name of tensor {i}")
    name = raw.decode("utf-8", "replace")
    dims = header.u32(f"the dimension count of tensor {name}")
    if dims > _MAX_DIMS:
        raise _Short(f"tensor '{name}' has {dims:,} dimensions (at most {_MAX_DIMS})")
    shape = [header.u64(f"the shape of tensor '{name}'") for _ in range(dims)]
    kind = header.u32(f"the type of tensor '{name}'")
    return name, shape, kind, header.u64(f"the data offset of tensor '{name}'")


def check_layout(label: str, tensors: list[tuple[str, list[int], int, int]], alignment: int, data_size: int) -> None:
    """Each tensor's type known, its shape a whole number of blocks, its offset aligned, and its bytes inside the
    data section and its own (see the module doc).

    Example:
        >>> check_layout("GGUF file 'm.gguf'", [("a", [64], 0, 0), ("b", [64], 0, 0)], 32, 512)
        Traceback (most recent call last):
        neutrain.errors.CheckpointError: GGUF file 'm.gguf': tensors 'b' and 'a' share bytes (data bytes 0..256 and 0..256); each tensor must have bytes of its own
    """
    ranges, names = [], set()
    for name, shape, kind, offset in tensors:
        if name in names:
            raise CheckpointError(f"{label}: tensor '{name}' is described twice")
        names.add(name)
        if kind not in GGML_BLOCKS:
            raise CheckpointError(f"{label}: tensor '{name}' has the unknown tensor type {kind}")
        block, block_bytes = GGML_BLOCKS[kind]
        if shape and shape[0] % block:
            raise CheckpointError(f"{label}: tensor '{name}' has rows of {shape[0]:,} elements, not a whole number of "
                                  f"its type's {block}-element blocks")
        if offset % alignment:
            raise CheckpointError(f"{label}: tensor '{name}' starts at data byte {offset:,}, not a multiple of the "
                                  f"alignment {alignment}")
        numel = 1
        for dim in shape:
            numel *= dim
        ranges.append((name, offset, offset + numel // block * block_bytes))
    check_ranges(label, ranges, data_size, CheckpointError)
