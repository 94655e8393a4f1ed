"""Inference with compressed weights: the output head decoded in row chunks.

A :class:`~neutrain.nn.CompressedLinear` decodes its whole matrix into a shared
buffer before multiplying. For Llama-3-8B's lm_head (128,256 x 4,096) that
buffer is 1 GiB, more than all the layer buffers together, and it would sit in
every inference run's peak memory. :class:`ChunkedHeadLinear` decodes the head
a block of whole tiles at a time (rows aligned to the codec's tiles, ~32 M
elements per block) and multiplies each block as it comes: peak extra memory
is one block, and the work is the same single pass over the compressed bytes.

Only inference takes this path (no autograd, CUDA, the Triton decoder);
training and the CPU keep :class:`CompressedLinear`'s full decode, which is
also the reference the chunked path is tested against.

Example:
    >>> model = AutoModelForCausalLM.from_pretrained("out/neuzip")   # doctest: +SKIP
    >>> chunk_output_head(model)                                      # doctest: +SKIP
"""

from __future__ import annotations

import math

import torch

from neutrain.compress.tensor import _use_kernel
from neutrain.nn import CompressedLinear

CHUNK_ELEMENTS = 32 << 20
"""Elements decoded per block (64 MiB of bf16)."""
COUNTERS = {"chunked_head": 0}
"""Forward calls that took the chunked path (tests check that it really ran)."""


def _kernel_path(ct) -> bool:
    return _use_kernel(ct.layout, ct.elems, ct.device, "auto")


def aligned_rows(ct, cols: int, target: int | None = None) -> int | None:
    """Rows per block: a multiple of the rows that end exactly on a tile boundary, about ``target`` elements
    (default :data:`CHUNK_ELEMENTS`).

    None when even one aligned unit exceeds ``target`` (then the full decode is used).

    Example:
        >>> class _Ct: steps, lanes, elems = 64, 256, 4
        >>> aligned_rows(_Ct(), 4096)
        8192
    """
    target = CHUNK_ELEMENTS if target is None else target
    tile = ct.steps * ct.lanes * ct.elems
    unit = tile // math.gcd(tile, cols)
    if unit * cols > target:
        return None
    return unit * max(1, target // (unit * cols))


def decode_rows_block(ct, row0: int, row1: int, cols: int) -> torch.Tensor:
    """Rows ``row0:row1`` of the matrix (``row0 * cols`` on a tile boundary), decoded by the Triton kernel."""
    from neutrain.kernels import codec as kcodec  # lazy: Triton, GPU path only

    tile = ct.steps * ct.lanes * ct.elems
    t0, t1 = row0 * cols // tile, -(-row1 * cols // tile)
    ids = torch.arange(t0, min(t1, ct.tiles), device=ct.device)
    scratch = torch.empty(ids.numel() * tile, dtype=ct.dtype, device=ct.device)
    kcodec.decode(ct.stream, ct.lane_words, ct.tile_base, ct.tails, ct.lut, scratch, ct.numel, ct.steps, ct.lanes,
                  ct.layout.kept, ct.elems, tile_ids=ids)
    return scratch[: (row1 - row0) * cols].view(row1 - row0, cols)


class ChunkedHeadLinear(CompressedLinear):
    """A :class:`CompressedLinear` output head that, at inference on CUDA, decodes block by block.

    Shares the :class:`~neutrain.nn.CompressedWeight` of the module it replaces (a tied embedding stays tied).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ct = self.compressed.ct
        rows = aligned_rows(ct, self.in_features) if not torch.is_grad_enabled() else None
        if rows is None or rows >= self.out_features or not _kernel_path(ct):
            return super().forward(x)
        COUNTERS["chunked_head"] += 1
        x2 = x.reshape(-1, x.shape[-1])
        out = torch.empty(x2.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        for row0 in range(0, self.out_features, rows):
            row1 = min(row0 + rows, self.out_features)
            w = decode_rows_block(ct, row0, row1, self.in_features)
            bias = self.bias[row0:row1] if self.bias is not None else None
            out[:, row0:row1] = torch.addmm(bias, x2, w.t()) if bias is not None else x2.mm(w.t())
        return out.view(*x.shape[:-1], self.out_features)


def chunk_output_head(model: torch.nn.Module) -> bool:
    """Swap a compressed output head for :class:`ChunkedHeadLinear` in place; True if swapped."""

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not CompressedLinear:
        return False
    name = next(n for n, m in model.named_modules() if m is head)
    model.set_submodule(name, ChunkedHeadLinear(head.compressed, bias=head.bias))
    return True
