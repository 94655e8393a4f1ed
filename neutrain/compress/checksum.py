"""Checksum of a compressed tensor's stored blobs (Fletcher-style, on the tensors' device).

Why not CRC32 through ``zlib``: the blobs may live on a GPU, and copying
gigabytes to the host only to hash them would dominate saving. Two sums over the
concatenated bytes ``b_i`` are cheap vectorised torch reductions:

* ``s1 = sum(b_i) mod P`` changes by ``delta != 0`` (``|delta| <= 255 < P``) for
  any single changed byte, so **every single-byte corruption is detected**;
* ``s2 = sum((i + 1) * b_i) mod P`` also catches swapped or shifted bytes.

``P = 2**31 - 1`` keeps every product below ``2**39`` and every chunk sum far
below ``2**63``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

_PRIME = (1 << 31) - 1
_CHUNK = 1 << 24  # bytes per reduction: 64 MiB of fp32 scratch, whatever the tensor's size
_ROW = 256  # bytes per row of the exact fp32 product below
_VIA_GPU = 1 << 26  # host blobs from this size are summed on the GPU when there is one (see _sums)


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


def _sums(chunk: torch.Tensor, coeffs: torch.Tensor) -> tuple[int, int]:
    """``(sum(b_j), sum(j * b_j))`` of a uint8 chunk, exactly, from one fp32 matrix product.

    Rows of 256 bytes: a row's byte sum is below 2**16 and its ``sum(k * b_k)`` below 2**24, so
    fp32 (and TF32, whose 10-bit mantissa holds every byte and index below 256 exactly) adds them
    without rounding; the rows are then combined in int64. Scratch: 4 bytes per byte of the chunk,
    where the int64 definition took about 32.
    """
    n = chunk.numel()
    full = n - n % _ROW
    s1 = t = 0
    if full:
        rows = chunk[:full].view(-1, _ROW).to(torch.float32) @ coeffs  # (rows, 2): sum b_k, sum k * b_k
        rows = rows.to(torch.int64)
        base = torch.arange(0, full, _ROW, device=chunk.device, dtype=torch.int64)
        s1 = int(rows[:, 0].sum())
        t = int((base * rows[:, 0] + rows[:, 1]).sum())
    if full < n:
        tail = chunk[full:].to(torch.int64)
        s1 += int(tail.sum())
        t += int((torch.arange(full, n, device=chunk.device, dtype=torch.int64) * tail).sum())
    return s1, t


def checksum(blobs: Iterable[torch.Tensor]) -> torch.Tensor:
    """``int64[2]`` checksum (on the CPU) of the bytes of ``blobs``, in order.

    Equal to :func:`checksum_reference` (``s2``'s terms regrouped per chunk:
    ``sum((o + 1 + j) * b_j) = (o + 1) * sum(b_j) + sum(j * b_j)``), with bounded scratch: a
    chunk of 16 MiB at a time, 64 MiB of fp32, so saving a model under a tight device budget
    needs no room the size of a tensor (issue 27: the 8B's save ran out of memory here at
    14.5 GiB). Large host blobs are summed on the GPU when there is one, a chunk at a time:
    the CPU took minutes for the 89 GiB of an offloaded 70B's layers, the copy takes seconds.

    Example:
        >>> a = torch.arange(10, dtype=torch.int32)
        >>> b = a.clone(); b[3] += 1
        >>> bool((checksum([a]) != checksum([b])).any())
        True
        >>> torch.equal(checksum([a, b]), checksum_reference([a, b]))
        True
    """
    sum1, sum2, offset = 0, 0, 0
    coeffs = {}
    for blob in blobs:
        data = blob.detach().contiguous().reshape(-1).view(torch.uint8)
        device = data.device
        if device.type == "cpu" and data.numel() >= _VIA_GPU and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in coeffs:
            k = torch.arange(_ROW, dtype=torch.float32, device=device)
            coeffs[device] = torch.stack([torch.ones_like(k), k], dim=1)
        for chunk in data.split(_CHUNK):
            s1, t = _sums(chunk.to(device, non_blocking=False), coeffs[device])
            sum1 += s1
            sum2 += ((offset + 1) % _PRIME) * (s1 % _PRIME) + t
            offset += chunk.numel()
    return torch.tensor([sum1 % _PRIME, sum2 % _PRIME], dtype=torch.int64)
