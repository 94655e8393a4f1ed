"""Where speculative generation keeps its KV caches on the ``DynamicCache`` path.

* :class:`DynamicTarget` / :class:`DynamicDraft`: transformers' ``DynamicCache``; keeping the accepted
  path or a draft row re-indexes (and reallocates) every layer's tensors (:mod:`neutrain.compat`).

Every method takes host-side lengths and tokens; the logits come back on the model's device. The
decode engines' static caches (``generate(..., engine=True)``) are driven by
:mod:`neutrain.speculative.rounds` instead, whose rounds never wait for host-side lengths.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from neutrain.compat import (
    cache_batch_size,
    cache_crop_to,
    cache_keep_positions,
    cache_repeat_rows,
    cache_select_row,
    output_cache,
)
from neutrain.speculative.tree import TokenTree, cache_kwargs, tree_forward


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def forward_with_cache(model, tokens: torch.Tensor, positions: torch.Tensor, cache):
    """``model`` on ``tokens [B, q]`` at ``positions [B, q]`` on top of ``cache``; returns (logits, cache)."""
    out = model(input_ids=tokens, position_ids=positions, use_cache=True, **cache_kwargs(model, cache))
    return out.logits, output_cache(out)


class DynamicTarget:
    """The target's ``DynamicCache``: holds every committed token but the last."""

    def __init__(self, model):
        self.model, self.device, self.cache = model, model_device(model), DynamicCache()

    def prefill(self, prefix: list[int]) -> None:
        if prefix:  # a one-token prompt has nothing to cache yet
            tokens = torch.tensor(prefix, device=self.device)[None]
            _, self.cache = forward_with_cache(self.model, tokens, torch.arange(len(prefix), device=self.device)[None], None)

    def verify(self, tree: TokenTree, past: int) -> torch.Tensor:
        """Logits ``[N, V]`` of every tree node (one forward)."""
        return tree_forward(self.model, tree, self.cache, past)

    def keep(self, past: int, accepted_nodes: list[int]) -> None:
        """Keep the prefix, the tree's root and the accepted nodes."""
        keep = torch.cat([torch.arange(past), past + torch.tensor([0] + accepted_nodes)]).to(self.device)
        cache_keep_positions(self.cache, keep)


class DynamicDraft:
    """A draft's ``DynamicCache``: one row for the committed prefix, ``rows`` while drafting."""

    def __init__(self, model, rows: int):
        self.model, self.device, self.rows, self.cache = model, model_device(model), rows, None

    def feed(self, tokens: list[int], start: int) -> torch.Tensor:
        """Cache committed ``tokens`` from position ``start``; the next-token logits ``[V]`` after them."""
        ids = torch.tensor(tokens, device=self.device)[None]
        positions = torch.arange(start, start + len(tokens), device=self.device)[None]
        logits, self.cache = forward_with_cache(self.model, ids, positions, self.cache)
        return logits[0, -1]

    def fan_out(self) -> None:
        """From one row to ``rows`` identical rows (the K drafts branch after their first token)."""
        if self.rows > 1:
            cache_repeat_rows(self.cache, self.rows)

    def step(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        """Each row's next-token logits ``[rows, V]`` after its ``tokens [rows]`` at ``position``."""
        pos = torch.full((tokens.shape[0], 1), position, device=self.device)
        logits, self.cache = forward_with_cache(self.model, tokens[:, None], pos, self.cache)
        return logits[:, -1]

    def keep(self, row: int, start: int, length: int) -> None:
        """Keep row ``row`` (its columns from ``start`` on differ from the others') up to ``length``."""
        if cache_batch_size(self.cache) > 1:
            cache_select_row(self.cache, row)
        cache_crop_to(self.cache, length)
