"""neutrain: memory-efficient full fine-tuning of large language models.

The top-level package stays light: importing ``neutrain`` imports neither
Triton nor any kernel. Heavy entry points are resolved lazily on first use.

Example:
    >>> import neutrain
    >>> neutrain.__version__
    '0.1.0'
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

def _guard_start() -> None:
    # First: a Ctrl-C during the imports below is one line and exit 130, not their traceback
    # (neutrain.starting; only when this process is the `neutrain` command).
    # lazy: a function, so the import runs once at package import and leaves no module-level name behind.
    from neutrain.starting import guard_start

    guard_start()


_guard_start()

# name -> "module:attribute", resolved on first access (PEP 562).
_LAZY = {
    "NeuTrainer": "neutrain.trainer:NeuTrainer",
    "load_recipe": "neutrain.config:load_recipe",
    "compress_model": "neutrain.nn:compress_model",
    "load_compressed": "neutrain.nn:load_compressed",
}


def _register_neuzip_quantizer() -> None:
    # `from_pretrained` of a NeuZip export needs quant_method "neuzip" registered; this only installs
    # an import hook (standard library), so importing neutrain still imports neither torch nor transformers.
    # lazy: a function, so the import runs once at package import and leaves no module-level name behind.
    from neutrain.export.registration import install

    install()


_register_neuzip_quantizer()


def _register_optimizers_and_caches() -> None:
    # A recipe's train.optimizer, eval.kv_caches and eval.long_context_tasks are checked against the names the
    # registries fill (neutrain.config.schema.Names), so they are imported before any recipe can be read; none
    # imports torch.
    # lazy: a function, so the imports run once at package import and leave no module-level name behind.
    from neutrain.eval.kv import registry as kv_caches  # noqa: F401
    from neutrain.eval import tasks as long_context_tasks  # noqa: F401  # lazy: as above
    from neutrain.optim import registry as optimizers  # noqa: F401  # lazy: as above


_register_optimizers_and_caches()


def __getattr__(name: str):
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'neutrain' has no attribute {name!r}")
    module_name, attr = target.split(":")
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
