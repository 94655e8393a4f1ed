"""``CompressedEmbedding``: an embedding table that decodes only the rows a batch uses.

Forward decodes the looked-up rows with ``ct.decompress_rows`` (a few tiles, not
the table). Backward builds the dense table gradient with the same op autograd
uses for ``nn.Embedding`` (``embedding_dense_backward``, so gradients are
bit-identical to the dense twin) and hands it to the fused optimizer. When the
table is tied to the lm_head, both modules share one :class:`CompressedWeight`
and the optimizer sums the two contributions and updates once, at the end of
backward.

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
            grad_w = torch.ops.aten.embedding_dense_backward(
                grad_out, ids, weight.shape[0], ctx.padding_idx, False
            )
            weight.apply_grad(grad_w)
        return None, None, None, None


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
                f"{self.compressed.ct!r}")
