"""Batch-1 GEMV: the pure-PyTorch reference of :mod:`neutrain.kernels.gemv` and the per-shape routing.

A decode step's linears at batch 1 are matrix-vector products. Whether cuBLAS (``F.linear``) or the
split-K Triton kernel is faster depends on the shape and the card, so the choice is measured:
``benchmarks/decode/engine_decode.py`` (``choose_gemv``) times each candidate on the device and keeps the
fastest per ``(N, K)`` for Llama-3-8B's shapes, :func:`table_from` turns its rows into a table, and :class:`GemvDispatch`
(``DecodeEngine(gemv=table)``) routes every one-row, bias-free ``F.linear`` of those shapes to the
chosen kernel while the engine's model runs; other calls stay ``F.linear``. The model is not changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

def gemv_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` accumulated in fp32 (float64 for float64 inputs), returned in ``w``'s dtype.

    Example:
        >>> import torch
        >>> gemv_reference(torch.ones(1, 3), torch.arange(6.0).view(2, 3)).tolist()
        [[3.0, 12.0]]
    """
    acc = torch.float64 if w.dtype == torch.float64 else torch.float32
    return (x.to(acc) @ w.to(acc).T).to(w.dtype)


def triton_gemv(block_n: int, block_k: int, split: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The Triton kernel with one configuration, as ``f(x, w)``."""
    from neutrain.kernels.gemv import gemv  # lazy: Triton only where a kernel runs

    return lambda x, w: gemv(x, w, block_n=block_n, block_k=block_k, split=split)


def table_from(rows: Iterable[dict]) -> dict[tuple[int, int], tuple[int, int, int]]:
    """``{(N, K): (block_n, block_k, split)}`` for the shapes of ``choose_gemv``'s rows where a Triton
    configuration beat cuBLAS (the others stay on cuBLAS).

    Example:
        >>> table_from([{"n": 8, "k": 4, "best": "triton_n16_k256_s2"}, {"n": 4, "k": 4, "best": "cublas"}])
        {(8, 4): (16, 256, 2)}
    """
    table = {}
    for row in rows:
        if row["best"].startswith("triton_"):
            bn, bk, split = (int(part[1:]) for part in row["best"].split("_")[1:])
            table[(row["n"], row["k"])] = (bn, bk, split)
    return table


class GemvDispatch(TorchFunctionMode):
    """While active, ``F.linear(x, w)`` with one row ``x``, no bias and ``w.shape`` in ``table`` runs the Triton
    GEMV with that shape's configuration; every other call runs as it would. ``calls`` counts the routed ones.

    Example:
        >>> # with GemvDispatch({(6144, 4096): (16, 256, 1)}): model(ids)  # the fused QKV GEMV in Triton
    """

    def __init__(self, table: dict[tuple[int, int], tuple[int, int, int]]):
        super().__init__()
        self.table, self.calls = dict(table), 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1] if len(args) > 1 else kwargs.get("weight")
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            config = self.table.get(tuple(w.shape)) if w is not None and w.dim() == 2 else None
            if config is not None and bias is None and x.numel() == x.shape[-1] and w.stride(1) == 1:
                self.calls += 1
                return triton_gemv(*config)(x, w)
        return func(*args, **kwargs)
