"""Applying a gradient to a weight: the row-chunk driver every fused update rule runs on.

A rule (:class:`~neutrain.optim.LOMO`, :class:`~neutrain.optim.AdaLomo`,
:class:`~neutrain.optim.AdamWInBackward`) writes only the per-tensor arithmetic:
:meth:`ChunkedRule._rule_chunk` for the new fp32 values of a few rows (with
:meth:`ChunkedRule._begin_tensor` for per-tensor scalars), or a whole
:meth:`ChunkedRule._update_tensor` for rules with whole-tensor statistics.

Memory: every update runs on row chunks of at most ``chunk_numel`` elements, so
the fp32 temporaries of one update are bounded (64 MiB each by default) whatever
the tensor size (a Llama-3 lm_head has 525 M elements). The write-back is where
the non-finite policy meets the weights: an element keeps its old value wherever
the gradient was non-finite or the new value is not finite.
"""

from __future__ import annotations

from typing import Iterable

import torch

from neutrain.optim.clipping import as_rows, squared_norm
from neutrain.optim.grad_stats import GradStats
from neutrain.optim.rounding import SeededGenerators, stochastic_round_to_bf16


class ChunkedRule:
    """Mixin of :class:`~neutrain.optim.fused.FusedOptimizer`: apply a gradient to a weight, row chunk by row chunk.

    Subclasses override :meth:`_rule_chunk` (element-wise rules) or :meth:`_update_tensor`.
    The optimizer provides the attributes below (its state, index, parts and options).
    """

    chunk_numel: int
    stochastic_rounding: bool
    steps_done: int
    state: dict
    stats: GradStats
    _group_of: dict
    _index_of: dict
    _generators: SeededGenerators
    _updating_key: torch.Tensor | None

    @torch.no_grad()
    def update_(
        self,
        key: torch.Tensor,
        weight: torch.Tensor,
        grad: torch.Tensor,
        *,
        _ok: torch.Tensor | None = None,
        _sumsq: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Apply this optimizer's rule to ``weight`` in place and return it.

        The arithmetic is fp32; a bf16 weight is written back with stochastic
        rounding (if enabled), an fp32 weight exactly. A non-finite gradient
        leaves the weight and the optimizer state untouched, and no element of
        the weight ever becomes non-finite. Clipping follows ``clip_mode``.

        Args:
            key: the parameter in ``param_groups`` standing for the weight (its
                group's ``lr``/``weight_decay`` are read now; state lives in
                ``self.state[key]``).
            weight: contiguous tensor holding the current weight (bf16 or fp32).
            grad: gradient of the same shape.

        Returns:
            ``weight``, updated.

        Example:
            >>> w = torch.nn.Parameter(torch.ones(2, 2))
            >>> from neutrain.optim import LOMO
            >>> opt = LOMO([w], lr=0.5)
            >>> opt.update_(w, w.data, torch.ones(2, 2)).tolist()
            [[0.5, 0.5], [0.5, 0.5]]
        """
        if not weight.is_contiguous():
            raise ValueError("fused updates need a contiguous weight tensor")
        if grad.shape != weight.shape:
            raise ValueError(f"gradient shape {tuple(grad.shape)} != weight shape {tuple(weight.shape)}")
        sumsq = squared_norm(grad, self._chunk_rows(grad)) if _sumsq is None else _sumsq
        ok = torch.isfinite(sumsq) if _ok is None else _ok
        coef = self.stats.clip_coef(sumsq)
        self._updating_key = key  # rules with whole-tensor statistics sum them over shards (shard_sum_)
        self._update_tensor(weight, grad, self.state[key], self._group_of[key], ok, coef, self._generator(key, weight))
        return weight

    def _generator(self, key: torch.Tensor, weight: torch.Tensor) -> torch.Generator | None:
        if self.stochastic_rounding and weight.dtype == torch.bfloat16:
            return self._generators.for_update(weight.device, self._index_of[key], self.steps_done)
        return None


    def _chunk_rows(self, t: torch.Tensor) -> int:
        row_numel = max(1, weight_rows(t).shape[1])
        return max(1, self.chunk_numel // row_numel)

    def _row_chunks(self, t: torch.Tensor) -> Iterable[slice]:
        rows, step = weight_rows(t).shape[0], self._chunk_rows(t)
        return (slice(start, start + step) for start in range(0, rows, step))

    def _update_tensor(self, weight, grad, state, group, ok, coef, generator) -> None:
        """Default element-wise driver over the rows of a whole gradient."""
        g_rows = as_rows(grad)
        self._update_rows(weight, lambda rows: g_rows[rows], state, group, ok, coef, generator)

    def _update_rows(self, weight, grad_rows, state, group, ok, coef, generator) -> None:
        """Per row chunk: ``_rule_chunk`` on the chunk's gradient, then write back."""
        scalars = self._begin_tensor(weight, state, group, ok)
        w_rows = weight_rows(weight)
        for rows in self._row_chunks(weight):
            p32 = w_rows[rows].to(torch.float32, copy=True)
            new32 = self._rule_chunk(p32, grad_rows(rows), coef, state, group, rows, ok, scalars)
            self._write_rows(w_rows[rows], new32, ok, generator)

    def _begin_tensor(self, weight, state, group, ok):
        """Per-tensor prologue (state init, step counters); returns scalars for the chunks."""
        return None

    def _rule_chunk(self, p32, grad, coef, state, group, rows, ok, scalars) -> torch.Tensor:
        """Return the new fp32 values of weight rows ``rows``.

        ``p32`` is a private fp32 copy of the rows (update it in place); ``grad`` the
        raw gradient rows, to be scaled by the clip coefficient ``coef`` (None: 1).
        """
        raise NotImplementedError

    def _write_rows(self, dst: torch.Tensor, new32: torch.Tensor, ok: torch.Tensor, generator) -> None:
        if dst.dtype == torch.bfloat16 and generator is not None:
            new = stochastic_round_to_bf16(new32, generator, saturate=False)
        else:
            new = new32.to(dst.dtype)
        # Keep the old value wherever the gradient was non-finite or the result is not finite
        # (overflow, or rounding that carried into inf): no weight ever becomes non-finite. The fp32
        # value is tested too: CUDA's NaN is 0x7FFFFFFF, which the rounding noise wraps to a negative
        # pattern, -0.0, a finite bf16 that the test of ``new`` alone would store.
        keep_new = torch.isfinite(new).logical_and_(ok)
        if new is not new32:
            keep_new.logical_and_(torch.isfinite(new32))
        torch.where(keep_new, new, dst, out=dst)


def weight_rows(weight):
    """A weight as rows: :func:`~neutrain.optim.clipping.as_rows` of a tensor; a compressed weight's
    row blocks (``neutrain.nn.row_blocks.RowBlocks``, a streamed update's weight) are rows already.

    Example:
        >>> weight_rows(torch.zeros(2, 3, 4)).shape
        torch.Size([2, 12])
    """
    return as_rows(weight) if isinstance(weight, torch.Tensor) else weight


def scaled(g: torch.Tensor, coef: torch.Tensor | None) -> torch.Tensor:
    """The gradient in fp32, times the clip coefficient (a fresh tensor unless g is fp32 and unclipped).

    Example:
        >>> scaled(torch.ones(2, dtype=torch.bfloat16), torch.tensor(0.5)).tolist()
        [0.5, 0.5]
    """
    g32 = g.float()
    return g32 if coef is None else g32 * coef
