"""KV caches for evaluation: MiniCache (depth merging), ShadowKV (sparse, offloaded), the baselines, and the
registry that names them all (:mod:`neutrain.eval.kv.registry`).

Example:
    >>> from neutrain.eval.kv import MiniCache, enable_shadowkv, disable_shadowkv  # doctest: +SKIP
"""

from __future__ import annotations

import importlib

# name -> module, imported on first access (PEP 562): the package root reads the registry, which must not
# import torch, and importing it runs this file first.
_LAZY = {
    "MiniCache": "neutrain.eval.kv.minicache",
    "ShadowKVCache": "neutrain.eval.kv.shadowkv",
    "enable_shadowkv": "neutrain.eval.kv.shadowkv",
    "disable_shadowkv": "neutrain.eval.kv.shadowkv",
    "enable_minicache_attention": "neutrain.eval.kv.minicache_attention",
    "disable_minicache_attention": "neutrain.eval.kv.minicache_attention",
    "capture_decode_step": "neutrain.eval.kv.decode_graph",
    "GraphCaptureError": "neutrain.eval.kv.decode_graph",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'neutrain.eval.kv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
