"""Triton chunk gather for ShadowKV's offloaded values (zero-copy from pinned host memory).

ShadowKV keeps values in pinned CPU memory laid out ``[b, h, chunks, chunk*d]``
and, each decode step, needs the selected chunks on the GPU. Copying through a
CPU-side gather costs two host memcpys plus the transfer; instead, as in the
paper's CUDA ``gather_copy`` kernel, GPU threads read the pinned rows directly
over PCIe (CUDA unified addressing makes a pinned host pointer valid on the
device). One program copies one BLOCK-wide slice of one selected chunk row.

The reference is :func:`gather_chunks_reference` (``torch.gather``); the
ShadowKV layer in :mod:`neutrain.eval.kv.shadowkv` uses this kernel on CUDA and
counts its launches in :data:`COUNTERS`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting

COUNTERS = {"gather_chunks": 0}
"""Kernel launches, so tests can assert that the fast path ran."""


@triton.jit
def _gather_chunks_kernel(src_ptr, ids_ptr, out_ptr, num_chunks, k, row, BLOCK: tl.constexpr):
    pid = tl.program_id(0)  # one selected chunk of one (batch, head)
    part = tl.program_id(1)  # one BLOCK-wide slice of its row
    bh = pid // k
    chunk = tl.load(ids_ptr + pid).to(tl.int64)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row
    src = src_ptr + (bh.to(tl.int64) * num_chunks + chunk) * row + offs
    vals = tl.load(src, mask=mask)
    tl.store(out_ptr + pid.to(tl.int64) * row + offs, vals, mask=mask)


def gather_chunks_reference(src: torch.Tensor, chunk_ids: torch.Tensor) -> torch.Tensor:
    """``src`` [b, h, C, row], ``chunk_ids`` [b, h, k] -> [b, h, k, row] (on ``src``'s device)."""
    ids = chunk_ids.to(src.device)
    return src.gather(2, ids[..., None].expand(-1, -1, -1, src.shape[-1]))


def gather_chunks(src: torch.Tensor, chunk_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Gather chunk rows of ``src`` [b, h, C, row] selected by ``chunk_ids`` [b, h, k] into ``chunk_ids``' device.

    ``src`` may live in pinned host memory while ``chunk_ids`` is on the GPU: the
    kernel then reads host memory directly. Under ``TRITON_INTERPRET=1`` both are
    CPU tensors.
    """
    b, h, num_chunks, row = src.shape
    k = chunk_ids.shape[-1]
    if not src.is_contiguous():
        raise ValueError("gather_chunks needs a contiguous source")
    ids = chunk_ids.contiguous().to(torch.int32)
    if out is None:
        out = torch.empty(b, h, k, row, dtype=src.dtype, device=chunk_ids.device)
    block = 1024 if not interpreting() else triton.next_power_of_2(min(row, 64))
    grid = (b * h * k, triton.cdiv(row, block))
    _gather_chunks_kernel[grid](src, ids, out, num_chunks, k, row, BLOCK=block)
    COUNTERS["gather_chunks"] += 1
    return out
