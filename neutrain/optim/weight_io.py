"""How an update reaches a weight's storage: the one seam between the optimizer and the weights it changes.

Dense parameters are updated in ``param.data``; compressed weights
(:mod:`neutrain.nn`) decode for the update and re-encode after it; a shard
(:mod:`neutrain.distributed.shards`) exposes this rank's slice. The optimizer
sees all three through :class:`WeightIO`.
"""

from __future__ import annotations

from typing import Protocol

import torch

# Attribute set on placeholder parameters that stand for compressed weights (see neutrain.nn).
COMPRESSED_KEY_ATTR = "_neutrain_compressed_key"


class WeightIO(Protocol):
    """Access to the storage of one weight, for an update.

    ``read()`` returns a contiguous tensor that the optimizer updates in place;
    ``write_(t)`` stores it back (a no-op for dense parameters, a re-encode for
    compressed ones). A compressed vocabulary matrix may also offer ``row_blocks(chunk_rows)``
    (its rows, decoded a block at a time, or None) and ``write_blocks_(blocks)``, which the
    streamed update (:mod:`neutrain.optim.streamed`) uses instead, so the matrix is never
    decoded whole (:mod:`neutrain.nn.row_blocks`).
    Optional too: ``count_into(t)``, what an update kernel needs to do the
    re-encode's first pass as it stores ``t`` (compressed weights; see
    :mod:`neutrain.compress.counted`), or None.
    """

    def read(self) -> torch.Tensor: ...

    def write_(self, weight: torch.Tensor) -> None: ...


class DenseWeightIO:
    """Weight I/O for an ordinary parameter: updates land in ``param.data`` directly.

    Example:
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> io = DenseWeightIO(p)
        >>> io.write_(io.read().add_(1.0)); p.tolist()
        [1.0, 1.0]
    """

    def __init__(self, param: torch.Tensor):
        self.param = param

    def read(self) -> torch.Tensor:
        return self.param.data

    def write_(self, weight: torch.Tensor) -> None:
        if weight.data_ptr() != self.param.data.data_ptr():
            self.param.data.copy_(weight)
