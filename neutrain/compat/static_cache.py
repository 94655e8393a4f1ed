"""transformers' ``StaticCache`` and torch's CUDA-graph RNG, as the decode engine uses them.

Why this module: :class:`neutrain.decode.engine.DecodeEngine` keeps its KV cache in
transformers' own ``StaticCache`` (preallocated ``[batch, kv_heads, max_len, head_dim]`` tensors,
written in place) so that every Hugging Face causal LM runs its unmodified forward. The engine
needs three things the public API does not name:

* the device-side length of the cache. In 5.17 and 5.24 each ``StaticLayer`` keeps a 0-d
  ``cumulative_length`` tensor that its ``update`` reads to place new keys and advances in place,
  so a captured decode step writes at the right position on every replay; older 5.x releases
  placed keys at a ``cache_position`` keyword instead (not supported: :func:`new_static_cache`
  says so);
* setting that length (rewinding after rejected speculative tokens, or starting over);
* the key/value tensors, for moving accepted tree nodes into place.

Sliding-window or linear-attention layers keep a different layout and are refused.
"""

from __future__ import annotations

from typing import Any

import torch


def new_static_cache(model: Any, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> Any:
    """A transformers ``StaticCache`` for ``model`` with every layer allocated now, length 0.

    Example:
        >>> # cache = new_static_cache(model, 1, 256, torch.bfloat16, torch.device("cuda"))
        >>> # static_cache_length(cache)  -> tensor(0, device='cuda:0')
    """
    config = model.config.get_text_config(decoder=True)
    cache = _static_cache(config, max_len)
    refusal = _refusal(cache)
    if refusal:
        raise ValueError(refusal)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache.early_initialization(batch_size=batch, num_heads=heads, head_dim=head_dim, dtype=dtype, device=device)
    set_static_cache_length(cache, 0)
    return cache


def _static_cache(config: Any, max_len: int) -> Any:
    from transformers import (
        StaticCache,  # lazy: transformers loads only when a cache is built
    )

    return StaticCache(config=config, max_cache_len=max_len)  # layers are allocated later (early_initialization)


def _refusal(cache: Any) -> str | None:
    from transformers.cache_utils import StaticLayer  # lazy: as above

    kinds = {type(layer).__name__ for layer in cache.layers}
    if any(type(layer) is not StaticLayer for layer in cache.layers):
        return f"the decode engine needs full-attention layers only; this model's cache has {sorted(kinds)}"
    if not hasattr(cache.layers[0], "cumulative_length"):  # pragma: no cover - transformers < 5.17 layout
        return "this transformers release keeps no device-side cache length (StaticLayer.cumulative_length)"
    return None


def static_cache_refusal(model: Any) -> str | None:
    """Why the decode engine cannot hold ``model`` (sliding-window or linear-attention layers, an old
    transformers), or None if it can; nothing is allocated.

    Example:
        >>> # engine = static_cache_refusal(model) is None  # else decode with a DynamicCache
    """
    return _refusal(_static_cache(model.config.get_text_config(decoder=True), 2))


def static_cache_length(cache: Any) -> torch.Tensor:
    """The number of cached positions as a 0-d device tensor (layer 0's; all layers advance together).

    The tensor is the cache's own: it changes in place on every forward, so a CUDA graph that reads it
    sees the current value on each replay.
    """
    return cache.layers[0].cumulative_length


def set_static_cache_length(cache: Any, length: int | torch.Tensor) -> None:
    """Set every layer's length in place (a Python int or a device tensor; no host synchronisation).

    Positions at or past ``length`` keep stale keys: the engine's attention mask hides them and the
    next forward overwrites them.
    """
    for layer in cache.layers:
        if torch.is_tensor(length):
            layer.cumulative_length.copy_(length)
        else:
            layer.cumulative_length.fill_(int(length))


def static_cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(keys, values), ...]`` per layer, each ``[batch, kv_heads, max_len, head_dim]`` (the live tensors)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def register_graph_generator(graph: Any, generator: torch.Generator | None) -> None:
    """Let ``graph`` replay random draws from ``generator`` with fresh numbers on every replay.

    torch >= 2.5 captures a generator other than the default one only once it is registered with the
    graph (``CUDAGraph.register_generator_state``); the engine always samples from its own seeded one.
    """
    if generator is None:
        return
    register = getattr(graph, "register_generator_state", None)
    if register is None:  # pragma: no cover - torch < 2.5
        raise RuntimeError("this torch cannot capture a seeded CUDA generator in a CUDA graph (needs torch >= 2.5)")
    register(generator)
