"""Batch-1 GEMV: the pure-PyTorch reference of :mod:`neutrain.kernels.gemv` and the per-shape choice.

A decode step's linears at batch 1 are matrix-vector products. Whether cuBLAS (``F.linear``) or the
split-K Triton kernel is faster depends on the shape and the card, so the choice is measured:
:func:`choose_gemv` times each candidate on the device and keeps the fastest per ``(N, K)``
(``benchmarks/engine_decode.py`` records the table for Llama-3-8B's shapes), and :class:`GemvDispatch`
(``DecodeEngine(gemv=table)``) routes every one-row, bias-free ``F.linear`` of those shapes to the
chosen kernel while the engine's model runs; other calls stay ``F.linear``. The model is not changed.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

#: The Triton configurations tried per shape: (block_n, block_k, split).
CANDIDATES = tuple((bn, bk, s) for bn in (8, 16, 32) for bk in (256, 512) for s in (1, 2, 4))


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


def _event_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def choose_gemv(shapes: Iterable[tuple[int, int]], dtype=torch.bfloat16, device="cuda",
                candidates=CANDIDATES, warmup: int = 5, iters: int = 30) -> list[dict]:
    """Per ``(N, K)``: the median CUDA-event time of ``F.linear`` (cuBLAS) and of every Triton candidate on
    random inputs, each checked against :func:`gemv_reference` first; returns one row per shape with
    ``cublas_ms``, ``triton`` ({config: ms}), the ``best`` and its bytes read per second.

    Example:
        >>> # rows = choose_gemv([(4096, 14336)])  # on a GPU
    """
    rows = []
    for n, k in shapes:
        gen = torch.Generator(device=device).manual_seed(n * 7 + k)
        w = torch.randn(n, k, generator=gen, device=device).to(dtype)
        x = torch.randn(1, 1, k, generator=gen, device=device).to(dtype)
        want = gemv_reference(x, w).float()
        scale = want.abs().max().item()
        times = {"cublas": _event_ms(lambda: F.linear(x, w), warmup, iters)}
        errors = {}
        for config in candidates:
            f = triton_gemv(*config)
            name = "triton_n{}_k{}_s{}".format(*config)
            try:
                err = (f(x, w).float() - want).abs().max().item() / scale
                if err > 2e-2:  # a wrong result never wins
                    errors[name] = f"max relative error {err:.3g}"
                    continue
                times[name] = _event_ms(lambda f=f: f(x, w), warmup, iters)
            except Exception as exc:  # a config that does not compile here is skipped, with the reason
                errors[name] = f"{type(exc).__name__}: {exc}"[:200]
        best = min(times, key=times.get)
        rows.append({"n": n, "k": k, "times_ms": times, "errors": errors, "best": best,
                     "best_ms": times[best], "cublas_ms": times["cublas"],
                     "best_bytes_per_s": n * k * w.element_size() / (times[best] / 1e3)})
        del w, x
    return rows


def table_from(rows: Iterable[dict]) -> dict[tuple[int, int], tuple[int, int, int]]:
    """``{(N, K): (block_n, block_k, split)}`` for the shapes of :func:`choose_gemv`'s rows where a Triton
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
