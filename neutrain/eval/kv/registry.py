"""The KV caches the evaluation loop decodes with: one :class:`KVCacheSpec` each.

The recipe check (``eval.kv_caches``), the evaluation loop (:func:`neutrain.eval.loop.kv_cache_factory`)
and the benchmarks read a cache's spec here: its name, the factory that makes it for a model, the options
that factory gets unless the caller gives others, and what its decode step costs in memory.

A factory is a context manager, ``factory(model, **options)``, that prepares the model (a cache that needs
its own attention routes it there), yields a function making a fresh, empty cache per sample, and undoes
what it did when the block ends. A new cache is one file holding its cache class and its factory, and one
:func:`register_kv_cache` call: below, for one that ships with neutrain, or anywhere before the recipe is
loaded for one of your own::

    register_kv_cache(KVCacheSpec("paged", "my_package.paged:paged_cache_factory"))

Why this module imports no torch: the recipe check runs before torch is imported, and the package root
imports this module so that every recipe is checked against every registered name. So a spec names its
factory as ``"module:attribute"``, imported when a cache is first made; a function passed itself works too.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from neutrain.config.schema import KV_CACHES

CacheFactory = Callable[..., AbstractContextManager[Callable[[], Any]]]


@dataclass(frozen=True)
class KVCacheSpec:
    """One KV cache.

    Args:
        name: what ``eval.kv_caches`` and ``kv_cache_factory(model, name)`` call it.
        factory: the context manager described above, or ``"module:attribute"`` naming it.
        options: keyword options the factory gets beneath the caller's (a kvpress press's name, say).
        in_recipes: whether a recipe may name it. The baselines are off: they need packages a run may lack
            (``optimum-quanto`` or ``hqq``, ``kvpress``), which a run would find missing only after training.
        restore_bytes: its memory cost beyond what it stores: the bytes, per element of one layer's keys, of
            the bf16 copy of a compressed layer (keys, values and their temporaries) that its decode step
            restores before attention; 0 for a cache that restores none.
    """

    name: str
    factory: str | CacheFactory
    options: Mapping[str, Any] = field(default_factory=dict)
    in_recipes: bool = True
    restore_bytes: int = 0

    def resolve(self) -> CacheFactory:
        """The factory, imported if the spec names it."""
        if not isinstance(self.factory, str):
            return self.factory
        module, _, attribute = self.factory.partition(":")
        return getattr(importlib.import_module(module), attribute)

    def open(self, model, **options) -> AbstractContextManager[Callable[[], Any]]:
        """The factory's context for ``model``, with the caller's ``options`` over :attr:`options`."""
        return self.resolve()(model, **{**self.options, **options})


_SPECS: dict[str, KVCacheSpec] = {}


def register_kv_cache(spec: KVCacheSpec) -> KVCacheSpec:
    """Make ``spec.name`` a cache the evaluation loop can make (and, with ``in_recipes``, a recipe can name)."""
    if spec.name in _SPECS:
        raise ValueError(f"KV cache {spec.name!r} is registered already; choose another name")
    _SPECS[spec.name] = spec
    if spec.in_recipes:
        KV_CACHES.add(spec.name)
    return spec


def unregister_kv_cache(name: str) -> None:
    """Undo :func:`register_kv_cache` (a test's own cache, once the test is done)."""
    spec = _SPECS.pop(name)
    if spec.in_recipes:
        KV_CACHES.remove(name)


def kv_cache_spec(name: str) -> KVCacheSpec:
    """The spec of cache ``name``; ``ValueError`` naming the registered ones for any other name."""
    try:
        return _SPECS[name]
    except KeyError:
        raise ValueError(f"kv must be one of {', '.join(_SPECS)}, got {name!r}") from None


def kv_cache_specs() -> tuple[KVCacheSpec, ...]:
    """Every registered cache, in registration order."""
    return tuple(_SPECS.values())


# ---------------------------------------------------------------- the caches neutrain ships
register_kv_cache(KVCacheSpec("full", "neutrain.eval.loop:full_cache_factory"))
# Restoring a MiniCache layer for the unfused decode: MiniCache merge + 4-bit ran out of memory at 31 sequences
# with 16 bytes budgeted (H200, 64K tokens), so 40 (benchmarks/kv/_kv_sizing.py sizes the throughput rows by it).
register_kv_cache(KVCacheSpec("minicache", "neutrain.eval.kv.minicache_attention:minicache_cache_factory",
                              restore_bytes=40))
register_kv_cache(KVCacheSpec("shadowkv", "neutrain.eval.kv.shadowkv:shadowkv_cache_factory"))
# The baselines users already run (neutrain.eval.kv.baselines); transformers' QuantizedCache fitted at 16.
register_kv_cache(KVCacheSpec("quantized", "neutrain.eval.kv.baselines:quantized_cache_factory", in_recipes=False,
                              restore_bytes=16))
for _press in ("snapkv", "streamingllm", "expected_attention"):
    register_kv_cache(KVCacheSpec(f"kvpress:{_press}", "neutrain.eval.kv.baselines:press_cache_factory",
                                  options={"press": _press}, in_recipes=False))
del _press
