"""KV-cache surgery for speculative decoding (DynamicCache, transformers 5.x).

transformers 5.x stores a ``DynamicCache`` as ``cache.layers[l].keys/.values``
(``[B, H, S, D]``); 4.x kept ``key_cache``/``value_cache`` lists. These helpers
touch only those tensors, so tree compaction works on both layouts.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch


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
    """``{"past_key_values": cache}`` or ``{"cache": cache}``, whichever ``model.forward`` names.

    transformers 5.2x renamed the forward argument ``past_key_values`` to ``cache``
    (the old name still works there, with a deprecation warning); 5.17 knows only
    ``past_key_values``.
    """
    name = _cache_argument(type(model))
    return {name: cache}


@functools.lru_cache(maxsize=None)
def _cache_argument(model_class) -> str:
    names = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in names and "past_key_values" not in names else "past_key_values"


def output_cache(output):
    """The cache returned by a forward (``.cache`` on newer 5.x, ``.past_key_values`` before)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)
