"""Routing a model's attention to a cache-aware implementation for as long as a compressed cache needs it.

ShadowKV and MiniCache decode inside the attention function (they need the query, which a
``Cache.update`` never sees) and so need the cache the module was called with: a forward pre-hook
puts it on the module as ``_<tag>_cache``. :func:`route_attention` registers the function, keeps the
model's previous implementation and installs the hooks; :func:`unroute_attention` undoes all of it.

Example:
    >>> import transformers
    >>> cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
    ...                                num_key_value_heads=2, intermediate_size=128, vocab_size=100)
    >>> model = transformers.AutoModelForCausalLM.from_config(cfg)
    >>> from neutrain import compat
    >>> route_attention(model, "demo", compat.sdpa_attention(), "demo")
    >>> model.config._attn_implementation, len(model._demo_hooks)
    ('demo', 1)
    >>> unroute_attention(model, "demo"); model.config._attn_implementation
    'sdpa'
"""

from __future__ import annotations

from typing import Callable

from ... import compat


def attention_modules(model):
    """The model's attention modules (they carry ``layer_idx``, ``scaling`` and ``num_key_value_groups``)."""
    return [mod for mod in model.modules()
            if hasattr(mod, "layer_idx") and hasattr(mod, "scaling") and hasattr(mod, "num_key_value_groups")]


def route_attention(model, name: str, fn: Callable, tag: str, setup: Callable | None = None) -> None:
    """Make ``fn`` the model's attention implementation ``name``; each attention module gets its cache as
    ``_<tag>_cache`` before every call, and ``setup(module)`` once. Calling it again replaces the hooks."""
    compat.register_attention_with_sdpa_mask(name, fn)
    if not hasattr(model, f"_{tag}_previous_attn"):
        setattr(model, f"_{tag}_previous_attn", model.config._attn_implementation)

    def capture(module, args, kwargs):
        setattr(module, f"_{tag}_cache", compat.cache_from_module_kwargs(kwargs))

    for handle in getattr(model, f"_{tag}_hooks", []):
        handle.remove()
    handles = []
    for mod in attention_modules(model):
        if setup is not None:
            setup(mod)
        handles.append(mod.register_forward_pre_hook(capture, with_kwargs=True))
    setattr(model, f"_{tag}_hooks", handles)
    compat.set_attn_implementation(model, name)


def unroute_attention(model, tag: str, module_attrs: tuple[str, ...] = (), model_attrs: tuple[str, ...] = ()) -> None:
    """Undo :func:`route_attention`: hooks, the cache on each module (and ``module_attrs``), the previous
    implementation back; ``model_attrs`` are removed from the model too."""
    for handle in getattr(model, f"_{tag}_hooks", []):
        handle.remove()
    for mod in model.modules():
        for attr in (f"_{tag}_cache", *module_attrs):
            if hasattr(mod, attr):
                delattr(mod, attr)
    previous = f"_{tag}_previous_attn"
    if hasattr(model, previous):
        compat.set_attn_implementation(model, getattr(model, previous))
        delattr(model, previous)
    for attr in (f"_{tag}_hooks", *model_attrs):
        if hasattr(model, attr):
            delattr(model, attr)
