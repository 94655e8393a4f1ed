"""``gemv``: one row times a weight matrix, ``y = x @ W.T``, for batch-1 decode, optionally split along K.

At batch 1 every linear of a decode step is a matrix-vector product bound by reading ``W`` once.
cuBLAS picks its kernel by heuristics; for a short-and-wide shape (Llama-3-8B's ``down_proj``:
4096 rows of 14336) few row blocks may leave SMs idle, for a tall one (the lm_head's 128256 rows)
the opposite. Here the grid is ``cdiv(N, BLOCK_N)`` row blocks times ``SPLIT`` slices of K:

* each program accumulates ``W[rows, slice] * x[slice]`` in fp32 over its slice (a
  ``BLOCK_N x BLOCK_K`` register tile, reduced once at the end);
* ``SPLIT == 1`` stores the output in the weight's dtype; ``SPLIT > 1`` stores fp32 partial sums
  ``[SPLIT, N]`` and a second kernel adds them in a fixed order and casts (deterministic: no atomics,
  so a greedy decode repeats itself).

Which configuration, or cuBLAS, is fastest is a question for the device: ``benchmarks/decode/engine_decode.py``
times each Llama-3-8B decode shape and records the winner. The pure-PyTorch reference is
:func:`neutrain.decode.gemv.gemv_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_w, k_per_split,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    start = pid_k * k_per_split
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(start, start + k_per_split, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if PARTIAL:
        tl.store(out_ptr + pid_k * N + rows, y, mask=row_ok)
    else:
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _sum_partials_kernel(part_ptr, out_ptr, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):  # a fixed order: the same sum on every call
        acc += tl.load(part_ptr + s * N + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def gemv(x: torch.Tensor, w: torch.Tensor, *, block_n: int = 16, block_k: int = 256, split: int = 1,
         num_warps: int = 4) -> torch.Tensor:
    """``x @ w.T`` for ``x`` holding ONE row (``[K]``, ``[1, K]``, ``[1, 1, K]``, ...) and ``w [N, K]``
    (unit stride along K); fp32 accumulation, output in ``w``'s dtype with ``x``'s leading shape.

    Example:
        >>> # y = gemv(x, layer.weight, block_n=16, block_k=256, split=4)  # == F.linear(x, layer.weight)
    """
    n, k = w.shape
    if x.shape[-1] != k or x.numel() != k:
        raise ValueError(f"gemv takes one row of {k} values, got x of shape {tuple(x.shape)}")
    if w.stride(1) != 1:
        raise ValueError("gemv needs the weight's rows contiguous (stride 1 along K)")
    if split < 1 or block_n < 1 or block_k < 1:
        raise ValueError(f"split, block_n and block_k must be >= 1 (got {split}, {block_n}, {block_k})")
    lead = x.shape[:-1]
    x = x.reshape(k).contiguous()
    out = torch.empty(n, dtype=w.dtype, device=w.device)
    per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, per_split)  # no empty slice
    grid = (triton.cdiv(n, block_n), split)
    if split == 1:
        _gemv_kernel[grid](x, w, out, n, k, w.stride(0), per_split, BLOCK_N=block_n, BLOCK_K=block_k,
                           PARTIAL=False, num_warps=num_warps)
    else:
        partial = torch.empty(split, n, dtype=torch.float32, device=w.device)
        _gemv_kernel[grid](x, w, partial, n, k, w.stride(0), per_split, BLOCK_N=block_n, BLOCK_K=block_k,
                           PARTIAL=True, num_warps=num_warps)
        block = 1024 if n >= 1024 else triton.next_power_of_2(n)
        _sum_partials_kernel[(triton.cdiv(n, block),)](partial, out, n, SPLIT=split, BLOCK=block)
    return out.view(*lead, n)
