"""A GGUF file's header, parsed once per process and checked against the file's size as it is read.

Why: a truncated GGUF file, or one whose header lies (a tensor count of 2^40, a string length past
the end), ended in a ``struct.error`` traceback from the ``gguf`` reader, and a lying count could
make a reader allocate for it. And loading one model parsed the same file about five times (the
header check, transformers' config and tokenizer readers, the tensor reader, the special tokens),
each through the ``gguf`` package's reader, which makes a numpy object per vocabulary entry: most
of a minute for SmolLM2's 49k tokens on a small CPU.

:func:`read_gguf` walks the header once (version, key-value metadata, tensor descriptions), every
length bounded by the bytes that remain, refuses the first thing that does not fit in one line
naming the file, and returns a :class:`GGUFIndex` that every reader of the file shares (one per
file and modification, memoized). Numeric arrays (a vocabulary's scores and token types) are numpy
views of the memory-mapped file; string arrays (tokens, merges) are decoded in one pass into lists.
Tensor data is not read.

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
from dataclasses import dataclass, field
from typing import Any

from neutrain.errors import CheckpointError
from neutrain.storage.gguf_metadata import check_metadata
from neutrain.storage.tensor_layout import check_ranges

_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
            12: "<f8"}  # value type -> numpy dtype (and struct format: the same letters)
_STRUCT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_MAX_DIMS = 8
DEFAULT_ALIGNMENT = 32
# ggml tensor type -> (elements per block, bytes per block), as gguf.constants.GGML_QUANT_SIZES has them.
GGML_BLOCKS = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40),
               10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
               16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82),
               23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2),
               34: (256, 54), 35: (256, 66), 39: (32, 17), 40: (64, 36), 41: (128, 18)}


class _Short(Exception):
    """The header needs more bytes than the file has left (the message says for what)."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's description: its name, dimensions (ggml order: fastest-moving first), ggml type and
    the offset of its data from :attr:`GGUFIndex.data_start`."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass(eq=False)
class GGUFIndex:
    """A GGUF file's parsed header and its memory map: what every reader of the file shares.

    Attributes:
        path: the file.
        version: 2 or 3.
        metadata: key -> value: ``int``/``float``/``bool``/``str`` scalars, a numpy array (a read-only
            view of the file) for an array of numbers, a list of ``str`` for an array of strings.
        kinds: key -> ``(value type, element type or None)``, the file's own type codes.
        tensors: the tensor table, in file order.
        data_start: the byte where tensor data begins (after the header, aligned).
        blob: the whole file as a read-only ``uint8`` memory map (pages are read when touched).
    """

    path: str
    version: int
    metadata: dict[str, Any]
    kinds: dict[str, tuple[int, int | None]]
    tensors: list[TensorEntry]
    data_start: int
    blob: Any = field(repr=False)

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")


_parses = 0


def parse_count() -> int:
    """How many GGUF headers this process has parsed (a test checks one file is parsed once)."""
    return _parses


class _Header:
    def __init__(self, blob, size: int):
        self.view, self.size, self.pos = memoryview(blob), size, 0

    def need(self, n: int, what: str) -> int:
        if n < 0 or self.pos + n > self.size:
            raise _Short(f"{what} needs {n:,} bytes at byte {self.pos:,}, past the end of the file ({self.size:,} bytes)")
        start = self.pos
        self.pos += n
        return start

    def scalar(self, kind: int, what: str):
        fmt = _STRUCT[kind]
        return struct.unpack_from(fmt, self.view, self.need(struct.calcsize(fmt), what))[0]

    def u32(self, what: str) -> int:
        return self.scalar(_UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(10, what)

    def string(self, what: str) -> str:
        length = self.u64(f"the length of {what}")
        start = self.need(length, what)
        try:
            return str(self.view[start:start + length], "utf-8")
        except UnicodeDecodeError:
            raise _Short(f"{what} at byte {start:,} is not UTF-8") from None

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings in a row: one pass, a str each (tokens and merges of a vocabulary)."""
        view, size, pos, out = self.view, self.size, self.pos, []
        unpack = struct.Struct("<Q").unpack_from
        for i in range(count):  # each element takes at least 8 bytes: the loop ends with the file
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"the length of element {i} of {what}")
            (length,) = unpack(view, pos)
            if pos + 8 + length > size:
                self.pos = pos + 8
                self.need(length, f"element {i} of {what}")
            try:
                out.append(str(view[pos + 8:pos + 8 + length], "utf-8"))
            except UnicodeDecodeError:
                raise _Short(f"element {i} of {what} at byte {pos + 8:,} is not UTF-8") from None
            pos += 8 + length
        self.pos = pos
        return out

    def value(self, kind: int, what: str, blob) -> tuple[Any, int | None]:
        if kind in _STRUCT:
            return self.scalar(kind, what), None
        if kind == _STRING:
            return self.string(what), None
        if kind != _ARRAY:
            raise _Short(f"{what} has the unknown value type {kind}")
        inner, count = self.u32(f"the element type of {what}"), self.u64(f"the length of {what}")
        if inner in _SCALARS:
            import numpy as np  # lazy: only a file's arrays need it

            dtype = np.dtype(_SCALARS[inner])
            start = self.need(dtype.itemsize * count, f"{what} ({count:,} elements)")
            return np.frombuffer(blob, dtype=dtype, count=count, offset=start), inner
        if inner == _STRING:
            return self.strings(count, what), inner
        raise _Short(f"element 0 of {what} has the unknown value type {inner}")


def _parse(path: str) -> GGUFIndex:
    import numpy as np  # lazy: the storage layer stays light for the commands that read no GGUF

    global _parses
    _parses += 1
    size = os.path.getsize(path)
    blob = np.memmap(path, mode="r", dtype=np.uint8) if size else np.zeros(0, dtype=np.uint8)
    header = _Header(blob, size)
    try:
        if bytes(header.view[header.need(4, "the magic number"):4]) != b"GGUF":
            raise CheckpointError(f"'{path}' is not a GGUF file (it does not start with 'GGUF')")
        version = header.u32("the version")
        if version not in (2, 3):
            raise CheckpointError(f"'{path}' is GGUF version {version}; neutrain reads versions 2 and 3")
        count, entries = header.u64("the tensor count"), header.u64("the metadata count")
        metadata, kinds = {}, {}
        for i in range(entries):
            key = header.string(f"metadata key {i}")
            kind = header.u32(f"the value type of metadata {i}")
            if key in metadata:
                raise _Short(f"metadata key {key!r} appears twice")
            metadata[key], inner = header.value(kind, f"metadata value {i}", blob)
            kinds[key] = (kind, inner)
        tensors = []
        for i in range(count):
            name = header.string(f"the name of tensor {i}")
            dims = header.u32(f"the dimension count of tensor {i}")
            if dims > _MAX_DIMS:
                raise _Short(f"tensor {i} has {dims:,} dimensions (at most {_MAX_DIMS})")
            start = header.need(8 * dims + 4, f"the shape and type of tensor {i}")
            shape = struct.unpack_from(f"<{dims}QI", header.view, start)
            offset = header.u64(f"the data offset of tensor {i}")  # inside the data section: check_layout
            tensors.append(TensorEntry(name, tuple(shape[:-1]), shape[-1], offset))
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if kinds.get("general.alignment", (_UINT32, None))[0] != _UINT32 or alignment <= 0 or alignment & (alignment - 1):
            raise _Short(f"general.alignment is {alignment!r}, not a power of two")
    except _Short as exc:
        raise CheckpointError(f"GGUF file '{path}': truncated or corrupt: {exc}") from None
    check_metadata(f"GGUF file '{path}'", metadata, kinds, CheckpointError)  # each value of the kind its reader takes
    data_start = -(-header.pos // alignment) * alignment
    check_layout(f"GGUF file '{path}'", [(t.name, list(t.dims), t.ggml_type, t.offset) for t in tensors], alignment,
                 max(size - data_start, 0))
    return GGUFIndex(str(path), version, metadata, kinds, tensors, data_start, blob)


_READ: dict[tuple, GGUFIndex] = {}
_KEEP = 2  # files remembered at once: a model and its draft


def read_gguf(path: str | os.PathLike) -> GGUFIndex:
    """The :class:`GGUFIndex` of the GGUF file at ``path``, parsed on the first call for this file as it is
    now (its real path, size, modification time and inode), then shared.

    Raises:
        CheckpointError: one line naming the file and the first part of the header that does not fit.
        OSError: the file cannot be opened.
    """
    real = os.path.realpath(path)
    st = os.stat(real)
    key = (real, st.st_size, st.st_mtime_ns, st.st_ino)
    index = _READ.get(key)
    if index is None:
        index = _parse(str(path))
        while len(_READ) >= _KEEP:
            _READ.pop(next(iter(_READ)))
        _READ[key] = index
    return index


def check_gguf_file(path: str | os.PathLike) -> None:
    """Refuse a GGUF file whose header is truncated, of an unknown version, or claims more than the file holds.

    Raises:
        CheckpointError: one line naming the file and the first part of the header that does not fit.
    """
    read_gguf(path)


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
