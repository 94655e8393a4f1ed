"""``CompressedEmbedding``: an embedding table that decodes only the rows a batch uses.

Forward decodes the looked-up rows with ``ct.decompress_rows`` (a few tiles, not
the table). Backward computes the table gradient with the same op autograd uses
for ``nn.Embedding`` (``embedding_dense_backward``, so gradients are
bit-identical to the dense twin). When the optimizer can take it row block by
row block (an element-wise rule on an untied table: :mod:`neutrain.optim.streamed`),
each block of rows is computed on demand from the batch's ids, so the
vocabulary-sized gradient (1 GiB for Llama-3-8B) never exists; otherwise the
whole gradient is built and handed over. When the table is tied to the lm_head,
both modules share one :class:`CompressedWeight` and the optimizer sums the two
contributions and updates once, at the end of backward.

Scaled embeddings (Gemma's ``*ScaledWordEmbedding``: rows times ``embed_scale``,
sqrt(hidden) for Gemma) keep their scale: ``scale`` is multiplied in exactly as
the original module does (a tensor scale cast to the rows' dtype first, a Python
float as it is), outside the autograd function, so the gradient carries the
factor as autograd would compute it for the dense module.
"""

from __future__ import annotations

import torch

from neutrain.nn.state import CompressedModuleMixin
from neutrain.nn.weight import CompressedWeight
from neutrain.optim.clipping import add_squared_norm_


class _CompressedEmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, key, weight: CompressedWeight, padding_idx: int | None):
        ctx.save_for_backward(ids)
        ctx.weight = weight
        ctx.padding_idx = -1 if padding_idx is None else padding_idx
        return weight.decode_rows(ids)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        weight: CompressedWeight = ctx.weight
        if ctx.needs_input_grad[1]:
            block = weight.streamed_chunk_rows()
            if block:
                _streamed_table_update(weight, grad_out, ids, ctx.padding_idx, block)
            else:
                grad_w = torch.ops.aten.embedding_dense_backward(
                    grad_out, ids, weight.shape[0], ctx.padding_idx, False
                )
                weight.apply_grad(grad_w)
        return None, None, None, None


def table_grad_rows(grad_out: torch.Tensor, ids: torch.Tensor, rows: slice, num_rows: int,
                    padding_idx: int) -> torch.Tensor:
    """Rows ``rows`` of ``embedding_dense_backward(grad_out, ids, num_rows, padding_idx)``, computed alone.

    Ids outside the block (and the padding id) are sent to one extra scratch row that is
    dropped, so each kept row sums the same tokens in the same order as the whole-table
    op: the rows are bit-identical to the corresponding rows of the full gradient.

    Example:
        >>> g, ids = torch.randn(5, 3), torch.tensor([4, 1, 4, 0, 2])
        >>> full = torch.ops.aten.embedding_dense_backward(g, ids, 6, -1, False)
        >>> torch.equal(table_grad_rows(g, ids, slice(2, 5), 6, -1), full[2:5])
        True
    """
    start, stop = rows.start, min(rows.stop, num_rows)
    width = stop - start
    local = ids - start
    outside = (local < 0) | (local >= width)
    if padding_idx >= 0:
        outside |= ids == padding_idx
    local = local.masked_fill(outside, width)
    return torch.ops.aten.embedding_dense_backward(grad_out, local, width + 1, width, False)[:width]


def _streamed_table_update(weight: CompressedWeight, grad_out: torch.Tensor, ids: torch.Tensor,
                           padding_idx: int, block: int) -> None:
    """Update the table from gradient row blocks computed on demand (twice: norm pass, then update).

    The squared norm is summed over the same blocks of ``block`` rows, in order, as the
    optimizer sums a whole gradient (:func:`~neutrain.optim.clipping.squared_norm`), so the
    norm, the clip coefficient and every updated row equal the whole-gradient path bit for bit.
    Costs two passes of ``vocab / block`` small backward ops (a ``block x hidden`` buffer each)
    instead of a ``vocab x hidden`` gradient.
    """
    num_rows = weight.shape[0]
    flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
    flat_ids = ids.reshape(-1)

    def grad_rows(rows: slice) -> torch.Tensor:
        return table_grad_rows(flat_grad, flat_ids, rows, num_rows, padding_idx)

    sumsq = torch.zeros((), dtype=torch.float32, device=grad_out.device)
    for start in range(0, num_rows, block):
        add_squared_norm_(sumsq, grad_rows(slice(start, start + block)))
    weight.apply_streamed_grad(grad_rows, sumsq)


class CompressedEmbedding(CompressedModuleMixin, torch.nn.Module):
    """``nn.Embedding`` with a compressed table.

    Args:
        weight: the :class:`CompressedWeight` (shared with a tied lm_head, if any).
        padding_idx: as ``nn.Embedding``: that row receives no gradient.
        scale: the original module's ``embed_scale`` (a 0-dim tensor or a float), or None.

    Example:
        >>> from neutrain.compress import compress
        >>> dense = torch.nn.Embedding(16, 4).bfloat16()
        >>> emb = CompressedEmbedding(CompressedWeight(compress(dense.weight.detach())))
        >>> ids = torch.tensor([[1, 5, 5]])
        >>> torch.equal(emb(ids), dense(ids))
        True
    """

    def __init__(self, weight: CompressedWeight, padding_idx: int | None = None,
                 scale: torch.Tensor | float | None = None):
        super().__init__()
        self.compressed = weight
        self.num_embeddings, self.embedding_dim = weight.shape
        self.padding_idx = padding_idx
        self.weight_key = weight.key
        if isinstance(scale, torch.Tensor):
            # Non-persistent, as in transformers: derived from the config, moves with the module.
            self.register_buffer("embed_scale", scale.detach().clone(), persistent=False)
        else:
            self.embed_scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = _CompressedEmbeddingFunction.apply(ids, self.weight_key, self.compressed, self.padding_idx)
        if self.embed_scale is None:
            return rows
        if isinstance(self.embed_scale, torch.Tensor):
            return rows * self.embed_scale.to(rows.dtype)
        return rows * self.embed_scale

    def extra_repr(self) -> str:
        scale = "" if self.embed_scale is None else f", embed_scale={float(self.embed_scale):g}"
        return (f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}{scale}, "
                f"{self.compressed._ct!r}")
