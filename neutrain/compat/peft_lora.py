"""peft's registry of custom LoRA layer types, behind one named adapter.

Why private: peft wraps only layer types it knows; a LoRA layer for
:class:`~neutrain.nn.CompressedLinear` is registered with
``LoraConfig._register_custom_module`` (peft >= 0.12; underscored, but the way
peft's own docs show for custom modules). A peft without it gets one clear line
instead of an ``AttributeError`` deep in ``get_peft_model``.

Example:
    >>> from peft import LoraConfig
    >>> import torch
    >>> from neutrain.compat.peft_lora import register_custom_lora_module
    >>> config = LoraConfig(r=4, target_modules=["proj"])
    >>> register_custom_lora_module(config, torch.nn.Bilinear, torch.nn.Module)
    >>> config._custom_modules[torch.nn.Bilinear] is torch.nn.Module
    True
"""

from __future__ import annotations

from typing import Any


def register_custom_lora_module(config: Any, base_type: type, lora_type: type) -> None:
    """Make ``config``'s LoRA wrap modules of ``base_type`` with ``lora_type``."""
    register = getattr(config, "_register_custom_module", None)
    if register is None:
        import peft  # lazy: only for the version in the message

        raise RuntimeError(f"peft {peft.__version__} cannot register custom LoRA layers "
                           f"(LoraConfig._register_custom_module is missing); install peft >= 0.12")
    register({base_type: lora_type})
