"""Register the ``neuzip`` quantizer with transformers on ``import neutrain``, without importing transformers.

``import neutrain`` must stay light (no torch, no transformers, no Triton), yet
``AutoModelForCausalLM.from_pretrained`` must find ``quant_method: neuzip``.
So :func:`install` registers at once if transformers' quantizer registry is
already imported, and otherwise puts a finder on ``sys.meta_path`` that
registers right after ``transformers.quantizers.auto`` is first imported
(which transformers does before any ``from_pretrained``), then removes itself.
This module imports only the standard library.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys

_TARGET = "transformers.quantizers.auto"
logger = logging.getLogger(__name__)


_QUANTIZER = "neutrain.export.quantizer"


def _register() -> None:
    if _QUANTIZER in sys.modules and not hasattr(sys.modules[_QUANTIZER], "register"):
        # The quantizer module is mid-import (its own import of transformers' registry brought us here): it
        # registers itself as its last line. Importing it from here failed as a circular import, and the
        # finder, gone by then, never registered: `neutrain generate` then could not load a NeuZip export.
        return
    try:
        from neutrain.export.quantizer import register  # lazy: stdlib-only module (import hook)

        register()
    except Exception as exc:  # never break `import transformers` over our extension
        logger.warning("neutrain: could not register the 'neuzip' quantizer with transformers (%s: %s); "
                       "NeuZip exports will not load", type(exc).__name__, exc)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of transformers' registry to register after it runs."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            uninstall()
            _register()

        spec.loader.exec_module = exec_then_register
        return spec


_FINDER = _RegisterAfterImport()


def install() -> None:
    """Register now if transformers' registry is loaded, else as soon as it is (idempotent)."""
    if _TARGET in sys.modules:
        _register()
    elif _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
