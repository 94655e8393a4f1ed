"""Top-k and top-p (nucleus) truncation of next-token scores, exactly as transformers' logits warpers do it.

Why the same operations, in the same order: ``neutrain generate --top-k 50 --top-p 0.9`` must sample from
the distribution a user gets from ``model.generate(do_sample=True, top_k=50, top_p=0.9)``. Hugging Face applies
``TemperatureLogitsWarper``, then ``TopKLogitsWarper``, then ``TopPLogitsWarper`` to float32 scores; a token is
removed by setting its score to ``-inf``. Every operation here has fixed shapes and no host synchronisation, so
the decode engine's CUDA graph captures it.

Example:
    >>> import torch
    >>> scores = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    >>> truncate(scores, top_k=2, top_p=1.0).tolist()
    [[-inf, 3.0, 2.0, -inf]]
"""

from __future__ import annotations

import torch


def check_truncation(top_k: int, top_p: float) -> None:
    """``top_k`` >= 0 (0 = off) and ``0 < top_p <= 1`` (1 = off), else ``ValueError``."""
    if not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = no top-k), got {top_k!r}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = no top-p), got {top_p!r}")


def truncate(scores: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_tokens_to_keep: int = 1) -> torch.Tensor:
    """``scores [B, V]`` (already divided by the temperature) with the tokens top-k, then top-p, remove set to -inf.

    ``top_k`` 0 and ``top_p`` 1.0 leave the scores as they are (transformers adds no warper for them).
    """
    if top_k:
        # TopKLogitsWarper: every score below the k-th highest goes (ties with it stay).
        k = min(max(top_k, min_tokens_to_keep), scores.size(-1))
        scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], -float("inf"))
    if top_p < 1.0:
        # TopPLogitsWarper: ascending order; the low tail whose probability mass is at most 1 - top_p goes.
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[..., -min_tokens_to_keep:] = 0
        scores = scores.masked_fill(remove.scatter(1, sorted_indices, remove), -float("inf"))
    return scores
