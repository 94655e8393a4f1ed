"""KV-cache surgery for speculative decoding (DynamicCache, transformers 5.x).

The forward-keyword and output drift (``past_key_values`` vs ``cache``) is
handled by :mod:`neutrain.compat`; this module only re-indexes cache tensors.

transformers 5.x stores a ``DynamicCache`` as ``cache.layers[l].keys/.values``
(``[B, H, S, D]``); 4.x kept ``key_cache``/``value_cache`` lists. These helpers
touch only those tensors, so tree compaction works on both layouts.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from neutrain.compat import cache_forward_kwarg, output_cache  # noqa: F401  (re-exported for generate)


def _map_cache(cache, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in layers:
            keys = getattr(layer, "keys", None)
            if keys is None or keys.numel() == 0:
                continue
            layer.keys, layer.values = fn(layer.keys), fn(layer.values)
        return
    for name in ("key_cache", "value_cache"):  # pragma: no cover - transformers 4.x layout
        tensors = getattr(cache, name)
        for i, t in enumerate(tensors):
            if t is not None and t.numel():
                tensors[i] = fn(t)


def cache_keep_positions(cache, positions: torch.Tensor) -> None:
    """Keep only sequence ``positions`` (sorted ascending) in every layer, in place."""
    _map_cache(cache, lambda t: t.index_select(-2, positions.to(t.device)))


def cache_crop(cache, length: int) -> None:
    """Keep the first ``length`` positions of every layer, in place."""
    _map_cache(cache, lambda t: t[..., :length, :])


def cache_select_batch(cache, row: int) -> None:
    """Keep batch row ``row`` only (batch size becomes 1), in place."""
    _map_cache(cache, lambda t: t[row : row + 1])


def cache_repeat_batch(cache, repeats: int) -> None:
    """Repeat a batch-1 cache ``repeats`` times along the batch dimension, in place."""
    _map_cache(cache, lambda t: t.expand(repeats, *t.shape[1:]).contiguous())


def cache_length(cache) -> int:
    return 0 if cache is None else int(cache.get_seq_length())


def cache_forward_kwargs(model, cache) -> dict:
    """``{name: cache}`` for the keyword ``model.forward`` takes its cache under (memoised per class)."""
    return {_cache_argument(type(model)): cache}


@functools.lru_cache(maxsize=None)
def _cache_argument(model_class) -> str:
    # compat inspects ``forward``'s signature; the unbound class method has the same parameters.
    return cache_forward_kwarg(model_class)
