"""Streamed updates: update a weight from gradient rows recomputed on demand, never the full gradient.

The chunked lm_head loss (:mod:`neutrain.nn.linear_cross_entropy`) can hand an
untied compressed weight its gradient as row chunks it recomputes, instead of
building the full gradient (saves a vocab x hidden bf16 tensor, 1 GiB on
Llama-3-8B, for two extra lm_head matrix products). Possible for element-wise
rules only, and only where nothing needs the whole gradient first (no tied
weight, no accumulation, no all-reduce or reduce-scatter).

Single pass: when the clip coefficient does not depend on this tensor's norm
(``none``, ``global_stale`` after its first step) and the rule keeps non-finite
elements by itself (LOMO), rows are updated as they are produced and the squared
norm is summed along the way, for the step's norm (logging, the next step's stale
coefficient) and its non-finite flag: the caller computes each gradient block
once. Otherwise the norm is measured first (a pass over all blocks), then the
blocks are produced again for the update.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from neutrain.optim.clipping import add_squared_norm_
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
        self.single_pass = 0  # of which in a single pass (norm summed along the way)

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
               sumsq: torch.Tensor | Callable[[], torch.Tensor]) -> None:
        """Update a weight from gradient row chunks, without a full-size gradient tensor.

        Same result, bit for bit, as ``consume_grad_`` with the full gradient,
        provided ``sumsq`` is accumulated as :func:`~neutrain.optim.clipping.squared_norm`
        does over the chunks of :meth:`chunk_rows` rows.

        When the optimizer :meth:`~neutrain.optim.fused.FusedOptimizer.updates_before_norm`,
        the update runs in a single pass: every chunk is requested once, in order, and the
        squared norm is summed from the chunks as they arrive; ``sumsq``, if a callable,
        is then never called. Otherwise the norm is needed before any row changes
        (per-tensor clip, whole-tensor non-finite skip): a callable ``sumsq`` is called
        first, then the chunks are requested.

        Args:
            key: the parameter standing for the weight.
            io: the weight's storage.
            grad_rows: ``grad_rows(rows: slice) -> Tensor``, the gradient of those rows;
                called once per chunk, in order.
            sumsq: the gradient's squared norm (0-dim fp32), or a callable measuring it
                (the caller's first pass, run only when needed).
        """
        opt = self.optimizer
        if opt.updates_before_norm():
            self._apply_single_pass(key, io, grad_rows)
            return
        if callable(sumsq):
            sumsq = sumsq()
        ok = opt.stats.account(key, sumsq)
        if ok is None:
            return
        blocks, weight = self._read(io)
        self._update(key, io, blocks, weight, grad_rows, ok, opt.stats.clip_coef(sumsq))

    def _read(self, io: WeightIO):
        """``(blocks, weight)``: a compressed vocabulary matrix's row blocks twice (decoded and re-encoded a
        block at a time, :mod:`neutrain.nn.row_blocks`: never whole), else ``(None, the weight read whole)``."""
        blocks_of = getattr(io, "row_blocks", None)
        blocks = blocks_of(rows_per_chunk(self.optimizer.chunk_numel, io.shape)) if blocks_of is not None else None
        return blocks, (io.read() if blocks is None else blocks)

    def _update(self, key, io: WeightIO, blocks, weight, grad_rows, ok: torch.Tensor, coef) -> None:
        """Run the rule over the rows of ``weight`` and store it back (whole, or block by block)."""
        opt = self.optimizer
        with opt.writing_to(io):
            opt._update_rows(weight, grad_rows, opt.state[key], opt._group_of[key], ok, coef,
                             opt._generator(key, weight))
        if blocks is None:
            io.write_(weight)
        else:
            io.write_blocks_(blocks)
        self.count += 1

    def _apply_single_pass(self, key: torch.Tensor, io: WeightIO, grad_rows: Callable[[slice], torch.Tensor]) -> None:
        """Update rows as they come; the norm (and the finiteness flag) is known only at the end.

        The coefficient does not read the norm in these modes; the rule runs with ``ok`` true and its
        write-back keeps every element whose new value is non-finite, i.e. whose gradient is
        (element-wise keep, as :meth:`~neutrain.optim.fused.FusedOptimizer.updates_before_norm` says).
        """
        opt = self.optimizer
        blocks, weight = self._read(io)
        total = torch.zeros((), dtype=torch.float32, device=weight.device)

        def measured(rows: slice) -> torch.Tensor:
            grad = grad_rows(rows)
            add_squared_norm_(total, grad)  # the chunks of squared_norm, in its order: the same sum
            return grad

        ok = torch.ones((), dtype=torch.bool, device=weight.device)
        self._update(key, io, blocks, weight, measured, ok, opt.stats.clip_coef(total))
        opt.stats.account(key, total)  # the step's norm and this tensor's non-finite flag
        self.single_pass += 1
