"""The combine of split-K decode attention: partial online softmaxes merged into one output row.

A one-token decode attends over thousands of tokens with one (batch row, KV head) a program, which leaves most
SMs idle at serving batches (168 programs for 132 SMs at batch 21 with 8 KV heads). The decode kernels
(:mod:`neutrain.kernels.minicache_attention`, :mod:`neutrain.kernels.shadowkv_fused_decode`) split the tokens over
more programs, each writing a partial ``(max, sum, unnormalised output)`` in log2 units; this kernel merges the
partials of one query head, slot by slot: ``out = sum_s w_s * acc_s / sum_s w_s * l_s`` with
``w_s = 2 ** (m_s - max m)``. A slot that saw no token holds ``(-1e30, 0, 0)`` and weighs nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, S, D: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    smask = s < S
    base = row.to(tl.int64) * S
    m = tl.load(m_ptr + base + s, mask=smask, other=-1.0e30)
    l = tl.load(l_ptr + base + s, mask=smask, other=0.0)
    acc = tl.load(acc_ptr + (base + s)[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
    w = tl.exp2(m - tl.max(m, axis=0))
    total = tl.sum(w * l, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / total
    tl.store(out_ptr + row.to(tl.int64) * D + d, out.to(out_ptr.dtype.element_ty))


def combine_partials(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Merge ``S`` partials a row into ``out``.

    Args:
        m, l: [rows, S] float32 running max (log2 units) and sum of each slot.
        acc: [rows, S, D] float32 unnormalised outputs.
        out: [rows, D] (any float dtype), written and returned.
    """
    rows, slots = m.shape[0], m.shape[-1]
    _combine_kernel[(rows,)](m, l, acc, out, slots, D=acc.shape[-1], BLOCK_S=triton.next_power_of_2(slots), num_warps=4)
    return out
