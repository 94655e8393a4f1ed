"""transformers' and the ``gguf`` package's GGUF readers, answered from one parsed header.

Why: loading a GGUF model reads its config (``AutoConfig.from_pretrained(..., gguf_file=...)``), its
tokenizer (``AutoTokenizer.from_pretrained(..., gguf_file=...)``) and its tensors, and each of these
parses the whole file again: transformers 5.17 through ``gguf.GGUFReader`` (a numpy object per
vocabulary entry: seconds for a 49k-token vocabulary), 5.24 through its own
``integrations.gguf.reader.read_gguf_metadata`` and, for architectures it has no config table for
(Llama among them), the legacy ``load_gguf_checkpoint`` as well. :func:`reading_from` makes each of
those entry points answer for the one file from a header neutrain parsed once
(:class:`neutrain.storage.gguf_header.GGUFIndex`, passed in: this layer imports no neutrain storage),
and leaves them alone for every other file. transformers' own conversions (config keys, tokenizer
classes) run unchanged.

The ``index`` taken here is anything with the attributes of a ``GGUFIndex``: ``path``, ``metadata``,
``kinds``, ``tensors``, ``data_start`` and ``blob``.

Needed by 5.17 and 5.24 (each parses a file several times per load); can go once transformers
accepts a parsed header, or parses a file once per process itself.

Example:
    >>> with reading_from(index):  # doctest: +SKIP
    ...     config = AutoConfig.from_pretrained(folder, gguf_file=name)
    ...     tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from typing import Any, Iterator

_VERSION_FIELDS = (("GGUF.version", 4), ("GGUF.tensor_count", 10), ("GGUF.kv_count", 10))
_DERIVED: "weakref.WeakKeyDictionary[Any, dict[str, Any]]" = weakref.WeakKeyDictionary()


def _derived(index) -> dict[str, Any]:
    """What has been computed from ``index`` once (its reader, transformers' metadata parse), kept with it."""
    return _DERIVED.setdefault(index, {})


class _Elements:
    """The elements of an array field as ``gguf.GGUFReader`` hands them out: element ``i`` is ``parts[i]``."""

    def __init__(self, values):
        self.values = values

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i: int):
        i %= len(self.values)
        value = self.values[i]
        if isinstance(value, str):  # what the reader's callers decode: the UTF-8 bytes
            return memoryview(value.encode("utf-8"))
        return self.values[i:i + 1]  # a one-element array, as the reader's callers index it


def _field(name: str, value, kind: int, inner: int | None):
    import numpy as np
    from gguf import GGUFValueType
    from gguf.gguf_reader import ReaderField

    if inner is not None:
        return ReaderField(0, name, _Elements(value), range(len(value)), [GGUFValueType(kind), GGUFValueType(inner)])
    part = memoryview(value.encode("utf-8")) if isinstance(value, str) else np.array([value])
    return ReaderField(0, name, [part], [0], [GGUFValueType(kind)])


class _Reader:
    """What callers read of a ``gguf.GGUFReader`` (``fields``, ``tensors``, ``data``, ``data_offset``,
    ``alignment``), from an index: the fields' element parts made on access, the tensors' data as views."""

    def __init__(self, index):
        import numpy as np
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.gguf_reader import ReaderTensor
        from gguf.quants import quant_shape_to_byte_shape

        self.data, self.data_offset = index.blob, index.data_start
        self.alignment = index.metadata.get("general.alignment", 32)
        counts = (index.version, len(index.tensors), len(index.metadata))
        self.fields = {name: _field(name, n, kind, None) for (name, kind), n in zip(_VERSION_FIELDS, counts)}
        self.fields.update((key, _field(key, value, *index.kinds[key])) for key, value in index.metadata.items())
        plain = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                 GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                 GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                 GGMLQuantizationType.I64: np.int64}
        self.tensors = []
        for entry in index.tensors:  # as gguf.GGUFReader._build_tensors lays each one out
            ggml_type = GGMLQuantizationType(entry.ggml_type)
            n_elements = int(np.prod(entry.dims, dtype=np.int64)) if entry.dims else 1
            block, size = GGML_QUANT_SIZES[ggml_type]
            n_bytes, start = n_elements * size // block, index.data_start + entry.offset
            shape = tuple(reversed(entry.dims))
            if ggml_type in plain:
                data = index.blob[start:start + n_bytes].view(plain[ggml_type]).reshape(shape)
            else:
                data = index.blob[start:start + n_bytes].reshape(quant_shape_to_byte_shape(shape, ggml_type))
            self.tensors.append(ReaderTensor(entry.name, ggml_type, np.array(entry.dims, dtype=np.uint64), n_elements,
                                             n_bytes, start, data, None))

    def get_field(self, key: str):
        return self.fields.get(key)

    def get_tensor(self, i: int):
        return self.tensors[i]


def gguf_reader(index) -> _Reader:
    """A stand-in for ``gguf.GGUFReader(index.path)`` built from ``index`` (once per index)."""
    derived = _derived(index)
    if "reader" not in derived:
        derived["reader"] = _Reader(index)
    return derived["reader"]


def _same_file(path, index) -> bool:
    try:
        return os.path.realpath(os.fspath(path)) == os.path.realpath(index.path)
    except TypeError:  # not a path (an open file, a buffer): not this file
        return False


def _metadata_as_transformers_reads_it(index, string_arrays=()) -> tuple[dict, tuple[str, ...]]:
    """``read_gguf_metadata``'s answer (5.24): arrays of numbers as lists, arrays of strings as their length
    unless asked for by key."""
    out = {}
    for key, value in index.metadata.items():
        inner = index.kinds[key][1]
        if inner is None:
            out[key] = value
        elif isinstance(value, list):
            out[key] = list(value) if key in string_arrays else len(value)
        else:
            out[key] = value.tolist()
    return out, tuple(entry.name for entry in index.tensors)


def checkpoint_metadata(index, load_gguf_checkpoint) -> dict:
    """``load_gguf_checkpoint(index.path, return_tensors=False)`` (config, tokenizer and tokenizer config
    dicts), computed once per index; each caller gets its own copy of the dicts."""
    derived = _derived(index)
    if "checkpoint" not in derived:
        with reading_from(index):
            derived["checkpoint"] = load_gguf_checkpoint(index.path, return_tensors=False)
    return {key: dict(value) if isinstance(value, dict) else value for key, value in derived["checkpoint"].items()}


@functools.lru_cache(maxsize=8)
def _tensor_name_map(get_tensor_name_map, arch, n_blocks):
    return get_tensor_name_map(arch, n_blocks)


@contextlib.contextmanager
def reading_from(index) -> Iterator[None]:
    """While inside, every GGUF reader transformers and ``gguf`` have answers for ``index.path`` from ``index``.

    Patched for that file only (any other path reaches the real reader): ``gguf.GGUFReader``,
    transformers' ``read_gguf_metadata`` (5.24) and ``load_gguf_checkpoint(..., return_tensors=False)``,
    and ``gguf.get_tensor_name_map``, which transformers' weight-name mapping rebuilt for every module
    of the model (hundreds of identical tables) and is memoized here.
    """
    import gguf
    from unittest import mock

    real_reader = gguf.GGUFReader

    def reader(path, *args, **kwargs):
        return gguf_reader(index) if _same_file(path, index) and not args and not kwargs else real_reader(path, *args, **kwargs)

    real_name_map = gguf.get_tensor_name_map
    patches = [mock.patch.object(gguf, "GGUFReader", reader), mock.patch.object(gguf.gguf_reader, "GGUFReader", reader),
               mock.patch.object(gguf, "get_tensor_name_map",
                                 lambda arch, n_blocks: _tensor_name_map(real_name_map, arch, n_blocks))]
    try:
        import transformers.modeling_gguf_pytorch_utils as legacy
    except ImportError:  # pragma: no cover - a transformers without GGUF support; its callers say so
        legacy = None
    if legacy is not None:
        real_checkpoint = legacy.load_gguf_checkpoint

        def load_gguf_checkpoint(path, return_tensors=False, *args, **kwargs):
            if _same_file(path, index) and not return_tensors and not args and not kwargs:
                return checkpoint_metadata(index, real_checkpoint)
            return real_checkpoint(path, return_tensors, *args, **kwargs)

        patches.append(mock.patch.object(legacy, "load_gguf_checkpoint", load_gguf_checkpoint))
    patches += _metadata_reader_patches(index)
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


def _metadata_reader_patches(index) -> list:
    """transformers 5.24's ``read_gguf_metadata``, in its module and in the lazy package that re-exports it."""
    from unittest import mock

    try:
        import transformers.integrations.gguf as package
        from transformers.integrations.gguf import reader as module
    except ImportError:  # 5.17: no such reader, the GGUFReader patch covers it
        return []
    real = getattr(module, "read_gguf_metadata", None)
    if real is None:  # a release without it reads through gguf.GGUFReader, patched already
        return []

    def read_gguf_metadata(path, string_arrays=()):
        return _metadata_as_transformers_reads_it(index, string_arrays) if _same_file(path, index) else real(path, string_arrays)

    return [mock.patch.object(module, "read_gguf_metadata", read_gguf_metadata),
            mock.patch.object(package, "read_gguf_metadata", read_gguf_metadata)]
