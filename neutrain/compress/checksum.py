"""Checksum of a compressed tensor's stored blobs (Fletcher-style, on the tensors' own device).

Two sums over the concatenated bytes ``b_i`` (``i`` from 0), each ``mod P``:

* ``s1 = sum(b_i)`` changes by ``delta != 0`` (``|delta| <= 255 < P``) for any
  single changed byte, so **every single-byte corruption is detected**;
* ``s2 = sum((i + 1) * b_i)`` also catches swapped or shifted bytes.

``P = 2**31 - 1``. The value is defined by these formulas alone, so any way of
computing them exactly gives the bytes every checkpoint already holds.

How, with scratch of 1/64 of the bytes hashed (a checksum must not
need a second copy of the model on the GPU). The bytes go in chunks of
``_CHUNK``; a chunk at ``offset`` is viewed as rows of ``_ROW`` bytes ``b[r, c]``
(index ``offset + _ROW * r + c``), so that

    sum_i (i + 1) b_i = (offset + 1) * S + _ROW * sum_r r * R_r + sum_c c * C_c

with ``S`` the chunk's byte sum, ``R_r`` its row sums and ``C_c`` its column
sums: two reductions of the bytes themselves and products over only
``n / _ROW + _ROW`` numbers, never an ``int64`` copy of the data (the old
``arange * bytes`` form took eight bytes of scratch per byte, 512 MiB per
chunk). Host tensors are summed by numpy, about twenty times faster than torch's
``uint8`` reductions on a CPU, so a checkpoint saved or read on the host hashes
at memory speed. Large host blobs go through the GPU when there is one, a chunk
at a time: an offloaded 70B's 89 GiB of layers took minutes on the host (the
first save on an H200 did not finish in five), a few seconds over the link.
All sums stay below ``2**57``: no ``int64`` overflow.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

_PRIME = (1 << 31) - 1
_CHUNK = 1 << 24
_ROW = 256
_DEVICE_CHUNK = 1 << 22
_VIA_GPU = 1 << 26  # host blobs from this size are summed on the GPU when there is one


def checksum_reference(blobs: Iterable[torch.Tensor]) -> torch.Tensor:
    """The definition, term by term in int64 (slow: 8 bytes of scratch per byte); the test oracle of :func:`checksum`."""
    sum1, sum2, offset = 0, 0, 0
    for blob in blobs:
        data = blob.detach().contiguous().reshape(-1).view(torch.uint8)
        for chunk in data.split(_CHUNK):
            values = chunk.to(torch.int64)
            weights = torch.arange(offset + 1, offset + 1 + values.numel(), device=values.device) % _PRIME
            sum1 += int(values.sum())
            sum2 += int(((weights * values) % _PRIME).sum())
            offset += values.numel()
    return torch.tensor([sum1 % _PRIME, sum2 % _PRIME], dtype=torch.int64)


def checksum(blobs: Iterable[torch.Tensor]) -> torch.Tensor:
    """``int64[2]`` checksum (on the CPU) of the bytes of ``blobs``, in order, hashed where they lie.

    Example:
        >>> a = torch.arange(10, dtype=torch.int32)
        >>> b = a.clone(); b[3] += 1
        >>> bool((checksum([a]) != checksum([b])).any())
        True
        >>> torch.equal(checksum([a, b]), checksum_reference([a, b]))
        True
    """
    sum1, sum2, offset = 0, 0, 0
    for blob in blobs:
        data = blob.detach().contiguous().reshape(-1).view(torch.uint8)
        host = data.device.type == "cpu"
        via = torch.device("cuda", torch.cuda.current_device()) if host and data.numel() >= _VIA_GPU \
            and torch.cuda.is_available() else None
        # On a device, torch's int64 reductions of a uint8 chunk upcast it whole (8 bytes a byte): a chunk of
        # 4 MiB keeps that scratch at 96 MiB under a tight budget; the host and the link take 16 MiB chunks.
        for chunk in data.split(_CHUNK if host else _DEVICE_CHUNK):
            if via is not None:
                total, weighted = _sums_torch(chunk.to(via))
            else:
                total, weighted = _sums_numpy(chunk.numpy()) if host else _sums_torch(chunk)
            sum1 += total
            sum2 += (offset + 1) * total + weighted
            offset += chunk.numel()
    return torch.tensor([sum1 % _PRIME, sum2 % _PRIME], dtype=torch.int64)


def _sums_numpy(chunk: np.ndarray) -> tuple[int, int]:
    """``(sum b_j, sum j * b_j)`` over one chunk, ``j`` from 0."""
    full = chunk.size - chunk.size % _ROW
    rows = chunk[:full].reshape(-1, _ROW)
    weighted = _ROW * int(rows.sum(axis=1, dtype=np.int64) @ np.arange(rows.shape[0], dtype=np.int64))
    weighted += int(rows.sum(axis=0, dtype=np.int64) @ np.arange(_ROW, dtype=np.int64))
    tail = chunk[full:].astype(np.int64)
    weighted += int(tail @ np.arange(full, chunk.size, dtype=np.int64))
    return int(chunk.sum(dtype=np.int64)), weighted


def _sums_torch(chunk: torch.Tensor) -> tuple[int, int]:
    """:func:`_sums_numpy` with torch reductions on the chunk's device (a GPU: no copy to the host)."""
    full = chunk.numel() - chunk.numel() % _ROW
    rows = chunk[:full].view(-1, _ROW)
    index = torch.arange(max(rows.shape[0], _ROW), device=chunk.device, dtype=torch.int64)
    weighted = _ROW * (rows.sum(dim=1, dtype=torch.int64) * index[: rows.shape[0]]).sum()
    weighted = weighted + (rows.sum(dim=0, dtype=torch.int64) * index[:_ROW]).sum()
    tail = chunk[full:].to(torch.int64)
    weighted = weighted + (tail * torch.arange(full, chunk.numel(), device=chunk.device)).sum()
    return int(chunk.sum(dtype=torch.int64)), int(weighted)
