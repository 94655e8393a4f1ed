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
_CHUNK = 1 << 24


def checksum(blobs: Iterable[torch.Tensor]) -> torch.Tensor:
    """``int64[2]`` checksum (on the CPU) of the bytes of ``blobs``, in order.

    Example:
        >>> a = torch.arange(10, dtype=torch.int32)
        >>> b = a.clone(); b[3] += 1
        >>> bool((checksum([a]) != checksum([b])).any())
        True
    """
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
