"""Streamed updates: update a weight from gradient rows recomputed on demand, never the full gradient.

The chunked lm_head loss (:mod:`neutrain.nn.linear_cross_entropy`) can hand an
untied compressed weight its gradient as row chunks it recomputes, instead of
building the full gradient (saves a vocab x hidden bf16 tensor, 1 GiB on
Llama-3-8B, for two extra lm_head matrix products). Possible for element-wise
rules only, and only where nothing needs the whole gradient first (no tied
weight, no accumulation, no all-reduce or reduce-scatter).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from neutrain.optim.weight_io import WeightIO


def rows_per_chunk(chunk_numel: int, weight_shape: torch.Size) -> int:
    """Rows of a ``weight_shape`` weight in an update chunk of at most ``chunk_numel`` elements (at least 1).

    Example:
        >>> rows_per_chunk(1 << 24, torch.Size([128256, 4096]))
        4096
    """
    return max(1, chunk_numel // max(1, math.prod(weight_shape[1:])))

class StreamedUpdates:
    """The streamed-update path of one fused optimizer.

    Args:
        optimizer: the optimizer whose rule runs the rows.
        enabled: ``allow_streaming`` of the optimizer.

    Example:
        >>> from neutrain.optim import LOMO, AdaLomo
        >>> w = torch.nn.Parameter(torch.zeros(4, 8))
        >>> LOMO([w], lr=0.1, chunk_numel=16).streamed.chunk_rows(w, w.shape), AdaLomo([w]).streamed.chunk_rows(w, w.shape)
        (2, None)
    """

    def __init__(self, optimizer: torch.optim.Optimizer, enabled: bool):
        self.optimizer = optimizer
        self.enabled = bool(enabled)
        self.count = 0  # updates applied from recomputed gradient rows (no full gradient)

    def chunk_rows(self, key: torch.Tensor, weight_shape: torch.Size) -> int | None:
        """Rows per chunk if ``key`` can be updated from gradient rows recomputed on demand, else None.

        Possible for element-wise rules (LOMO, AdamW) on untied weights without
        accumulation. The caller (the chunked lm_head loss) then never builds the
        full gradient: see :meth:`apply_`.
        """
        opt = self.optimizer
        if (not (self.enabled and opt.elementwise) or key in opt.hooks.tied or opt.gradient_accumulation_steps > 1
                or opt.grad_sync is not None or key in opt.shards):  # distributed: the full gradient is reduced
            return None
        return rows_per_chunk(opt.chunk_numel, weight_shape)

    def apply_(self, key: torch.Tensor, io: WeightIO, grad_rows: Callable[[slice], torch.Tensor],
               sumsq: torch.Tensor) -> None:
        """Update a weight from gradient row chunks, without a full-size gradient tensor.

        Same result, bit for bit, as ``consume_grad_`` with the full gradient,
        provided ``sumsq`` was accumulated as :func:`~neutrain.optim.clipping.squared_norm`
        does over the chunks of :meth:`chunk_rows` rows (the per-tensor norm,
        clipping and non-finite check need it before any row changes).

        Args:
            key: the parameter standing for the weight.
            io: the weight's storage.
            grad_rows: ``grad_rows(rows: slice) -> Tensor``, the gradient of those rows;
                called once per chunk, in order.
            sumsq: the gradient's squared norm (0-dim fp32).
        """
        opt = self.optimizer
        ok = opt.stats.account(key, sumsq)
        if ok is None:
            return
        # A compressed vocabulary matrix is decoded and re-encoded a row block at a time
        # (neutrain.nn.row_blocks): never whole. Other weights are read whole.
        blocks_of = getattr(io, "row_blocks", None)
        blocks = blocks_of(rows_per_chunk(opt.chunk_numel, io.shape)) if blocks_of is not None else None
        weight = io.read() if blocks is None else blocks
        coef = opt.stats.clip_coef(sumsq)
        state, group = opt.state[key], opt._group_of[key]
        with opt.writing_to(io):
            opt._update_rows(weight, grad_rows, state, group, ok, coef, opt._generator(key, weight))
        if blocks is None:
            io.write_(weight)
        else:
            io.write_blocks_(blocks)
        self.count += 1
