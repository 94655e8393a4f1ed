"""Compressed KV caches for evaluation: MiniCache (depth merging) and ShadowKV (sparse, offloaded).

Example:
    >>> from neutrain.eval.kv import MiniCache, enable_shadowkv, disable_shadowkv  # doctest: +SKIP
"""

from .minicache import MiniCache
from .minicache_attention import disable_minicache_attention, enable_minicache_attention
from .shadowkv import ShadowKVCache, disable_shadowkv, enable_shadowkv

__all__ = ["MiniCache", "ShadowKVCache", "enable_shadowkv", "disable_shadowkv", "enable_minicache_attention",
           "disable_minicache_attention"]
