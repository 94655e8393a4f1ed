"""A GGUF file's tensors one at a time, named and laid out as transformers loads them.

Why: ``from_pretrained(..., gguf_file=...)`` dequantizes every tensor of the file before the model
exists, so the whole dense model sits in host memory. neutrain compresses each tensor as soon as it
is read (:func:`neutrain.nn.gguf.load_gguf_compressed`), and needs the same tensors transformers
would load: llama.cpp names mapped to the model's parameter names, llama's Q/K rows un-permuted
(llama.cpp interleaves the rotary halves), MoE experts merged as the architecture's processor
merges them. Those rules live in transformers' private ``modeling_gguf_pytorch_utils``
(``load_gguf_checkpoint`` with ``return_tensors=False`` reads only the metadata,
``TENSOR_PROCESSORS``, ``get_gguf_hf_weights_map``); this adapter is the one place that touches them.
The file is memory-mapped once (its parsed header, :mod:`neutrain.compat.gguf_reader`), so a tensor's
bytes are read when it is dequantized.

Example:
    >>> for name, tensor in gguf_tensors(read_gguf("tiny.gguf"), skeleton, torch.bfloat16):  # doctest: +SKIP
    ...     print(name, tuple(tensor.shape))
    model.embed_tokens.weight (300, 64)
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Iterator

import numpy as np
import torch


def gguf_tensors(index, model, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(parameter name, tensor in dtype)`` for each tensor of the GGUF file ``index`` describes
    (a :class:`neutrain.storage.gguf_header.GGUFIndex`: the header parsed once, shared with the config
    and tokenizer readers through :mod:`neutrain.compat.gguf_reader`).

    ``model`` is the skeleton being filled (meta-device parameters are fine): its state dict names are
    what llama.cpp's names map to. Each tensor is dequantized to fp32 by the ``gguf`` package (as
    transformers does), processed, cast to ``dtype`` and handed over; nothing else is kept, and the
    file's pages read for it are given back to the kernel, so peak memory is one dequantized tensor.
    """
    from gguf import dequantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    from neutrain.compat.gguf_reader import checkpoint_metadata, gguf_reader, reading_from

    parsed = checkpoint_metadata(index, load_gguf_checkpoint)  # metadata only: config, tokenizer
    parsed.pop("tokenizer", None)
    reader = gguf_reader(index)
    architecture = index.metadata["general.architecture"]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])  # load_gguf_checkpoint always parses one
    with reading_from(index):  # the name tables, built once instead of once per module
        mapping = get_gguf_hf_weights_map(model, processor)
    parsed["tensors"] = {}  # processors that merge several tensors (MoE experts) put their results here
    for tensor in reader.tensors:
        _trim_heap()  # the consumer has compressed the previous tensor by now
        weights = _dequantize(dequantize, tensor)
        result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=mapping,
                                   parsed_parameters=parsed)
        del weights
        ready = [(name, parsed["tensors"].pop(name).to(dtype)) for name in list(parsed["tensors"])]
        if result.name in mapping:
            ready.append((mapping[result.name], _to_torch(result.weights, dtype)))
        del result
        _release_pages(reader, tensor)  # after the copy: F32 tensors are views of these pages
        while ready:
            yield ready.pop(0)


ROWS_PER_CHUNK = 256  # rows dequantized at once: numpy's block decoding makes ~3 fp32 temporaries per element


def _dequantize(dequantize, tensor) -> np.ndarray:
    """``gguf.dequantize`` of ``tensor`` (fp32), a chunk of rows at a time.

    Why: decoding a whole quantized matrix at once allocates several fp32 temporaries its size
    (a 49k x 576 Q4_1 embedding peaked at ~400 MB for a 113 MB result). Each row is a whole number
    of blocks, and blocks decode independently, so chunked rows give the same values.
    """
    data = tensor.data
    if data.ndim < 2 or data.shape[0] <= ROWS_PER_CHUNK:
        return dequantize(data, tensor.tensor_type)
    first = dequantize(data[:ROWS_PER_CHUNK], tensor.tensor_type)
    out = np.empty((data.shape[0], *first.shape[1:]), dtype=first.dtype)
    out[:ROWS_PER_CHUNK] = first
    for start in range(ROWS_PER_CHUNK, data.shape[0], ROWS_PER_CHUNK):
        out[start:start + ROWS_PER_CHUNK] = dequantize(data[start:start + ROWS_PER_CHUNK], tensor.tensor_type)
    return out


def _to_torch(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """``array`` as a torch tensor in ``dtype``, copying it only where it is a read-only view of the file."""
    if not array.flags.writeable or not array.flags.c_contiguous:
        array = np.ascontiguousarray(array).copy()  # F32 tensors come back as views of the memory map
    return torch.from_numpy(array).to(dtype)


def _trim_heap() -> None:
    """Give the heap's free pages back to the kernel (glibc's ``malloc_trim``; elsewhere nothing).

    Why: each tensor's dequantized copy and the codec's temporaries are freed, but glibc keeps the
    freed mid-sized chunks in its arena, and the resident set grew by about the compressed model's
    size again over a SmolLM2-135M load (408 MiB against 177 MiB of model; 240 MiB with the trim).
    """
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC(0)


_LIBC = None


def _release_pages(reader, tensor) -> None:
    """Drop the file pages ``tensor`` was read from out of this process's resident set.

    The memory map counts every page it has touched in the resident set until it is unmapped; without
    this, reading the file end to end would add the whole file to peak memory. The pages stay in the
    page cache, and a later read maps them again.
    """
    handle = getattr(reader.data, "_mmap", None)
    if not isinstance(handle, mmap.mmap) or not hasattr(handle, "madvise"):
        return
    start = tensor.data_offset - tensor.data_offset % mmap.PAGESIZE
    length = tensor.data_offset + tensor.n_bytes - start
    try:
        handle.madvise(mmap.MADV_DONTNEED, start, length)
    except (OSError, ValueError, AttributeError):  # a platform without it: only peak memory is higher
        pass
