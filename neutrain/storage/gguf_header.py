"""A GGUF file's header, checked against the file's size before any reader trusts its counts.

Why: a truncated GGUF file, or one whose header lies (a tensor count of 2^40, a string length past
the end), ended in a ``struct.error`` traceback from the ``gguf`` reader, and a lying count could
make a reader allocate for it. :func:`check_gguf_file` walks the header (version, key-value
metadata, tensor descriptions) with every length bounded by the bytes that remain, and refuses the
first thing that does not fit in one line naming the file. Only the header is read.

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

_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 8


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
            for i in range(entries):
                header.string(f"metadata key {i}")
                header.value(header.u32(f"the value type of metadata {i}"), f"metadata value {i}")
            for i in range(tensors):
                header.string(f"the name of tensor {i}")
                dims = header.u32(f"the dimension count of tensor {i}")
                if dims > _MAX_DIMS:
                    raise _Short(f"tensor {i} has {dims:,} dimensions (at most {_MAX_DIMS})")
                header.skip(8 * dims + 4, f"the shape and type of tensor {i}")
                offset = header.u64(f"the data offset of tensor {i}")
                if offset > size:
                    raise _Short(f"tensor {i}'s data starts at byte {offset:,} of the data, past the end of the file")
        except _Short as exc:
            raise CheckpointError(f"GGUF file '{path}': truncated or corrupt: {exc}") from None
