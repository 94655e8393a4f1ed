"""Where speculative generation keeps its KV caches: a growing ``DynamicCache`` or the decode engine's static one.

:func:`neutrain.speculative.generate` runs the same rounds on either; only the model calls and
the cache surgery differ:

* :class:`DynamicTarget` / :class:`DynamicDraft`: transformers' ``DynamicCache``; keeping the accepted
  path or a draft row re-indexes (and reallocates) every layer's tensors (:mod:`neutrain.compat`).
* :class:`EngineTarget` / :class:`EngineDraft`: a :class:`~neutrain.speculative.engine.DecodeEngine`
  with a static cache of ``max_len`` columns: the tree is verified with a mask over those columns,
  the accepted path is moved into place and the length cut, a draft's K rows live in a batch-K
  cache from the start and the kept row is copied over the others' last few columns.

Every method takes host-side lengths and tokens; the logits come back on the model's device. The
engine's cache length advances on the device with each forward and is set at the round's ends.
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
from neutrain.speculative.engine import DecodeEngine
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


class EngineTarget(DynamicTarget):
    """The target in a :class:`DecodeEngine`'s static cache of ``max_len`` columns (batch 1)."""

    def __init__(self, model, max_len: int):
        self.model, self.device = model, model_device(model)
        self.engine = DecodeEngine(model, max_len, cuda_graph=False)

    def prefill(self, prefix: list[int]) -> None:
        self.engine.set_length(0)
        if prefix:
            tokens = torch.tensor(prefix, device=self.device)[None]
            self.engine.forward(tokens, torch.arange(len(prefix), device=self.device))

    def verify(self, tree: TokenTree, past: int) -> torch.Tensor:
        n = len(tree)
        blocked = torch.ones(n, self.engine.max_len, dtype=torch.bool)
        blocked[:, :past] = False
        blocked[:, past : past + n] = ~tree.ancestor_matrix()  # the nodes land in columns past .. past + n - 1
        logits = self.engine.forward(tree.input_ids(self.device), tree.position_ids(past, self.device)[0],
                                     last_only=False, blocked=blocked.to(self.device))
        return logits[0]

    def keep(self, past: int, accepted_nodes: list[int]) -> None:
        self.engine.keep_columns(past, past + torch.tensor([0] + accepted_nodes))


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


class EngineDraft(DynamicDraft):
    """A draft in a batch-``rows`` :class:`DecodeEngine`: every row holds the committed prefix."""

    def __init__(self, model, rows: int, max_len: int):
        self.model, self.device, self.rows = model, model_device(model), rows
        self.engine = DecodeEngine(model, max_len, batch=rows, cuda_graph=False)

    def feed(self, tokens: list[int], start: int) -> torch.Tensor:
        self.engine.set_length(start)  # the cache holds the committed prefix up to ``start``
        ids = torch.tensor(tokens, device=self.device)[None].expand(self.rows, -1)
        return self.engine.forward(ids, torch.arange(start, start + len(tokens), device=self.device))[0, -1]

    def fan_out(self) -> None:  # the rows exist from the start
        pass

    def step(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        return self.engine.forward(tokens[:, None], torch.tensor([position], device=self.device))[:, -1]

    def keep(self, row: int, start: int, length: int) -> None:
        if self.rows > 1 and length > start:
            self.engine.copy_row(row, start, length)
        self.engine.set_length(length)
