"""LoRA adapters (peft) over a frozen NeuZip base, and merging them back.

The base model's matrices stay compressed and frozen (``neuzip-lossless`` or
``neuzip-lossy-<k>``); peft's LoRA layers wrap the
:class:`~neutrain.nn.CompressedLinear` modules and add ``B A x`` to their output.
Only the adapters train, with an ordinary optimizer (AdamW over the adapter
parameters), so a lossy base is fine: nothing is ever written back into it.
Compared with QLoRA, the frozen base is entropy-coded bf16 (lossless) or
rounded to k mantissa bits (lossy), not NF4.

* :func:`apply_lora` wraps a model (dense or compressed) with peft LoRA.
* :func:`neutrain.export.lora.merge_lora` folds the adapters into the weights and returns a
  plain transformers model, dense or compressed (one layer up: it needs the dense export path).

Example:
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                      num_attention_heads=4, num_key_value_heads=2)
    >>> model = LlamaForCausalLM(config).to(torch.bfloat16)
    >>> model = compress_model_for_adapters(model, "neuzip-lossy-3")
    >>> model = apply_lora(model, {"lora_r": 8, "lora_alpha": 16})
    >>> sum(p.numel() for p in model.parameters() if p.requires_grad)  # only the adapters train
    16384
    >>> # ... train the adapters ...
    >>> from neutrain.export.lora import merge_lora
    >>> merged = merge_lora(model, "neuzip-lossless")
    >>> type(merged).__name__
    'LlamaForCausalLM'
"""

from __future__ import annotations

import re
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from neutrain.compat.peft_lora import register_custom_lora_module
from neutrain.config.validate import section_from
from neutrain.errors import RecipeError

LOSSY = re.compile(r"^neuzip-lossy-(\d+)$")


def mantissa_bits_of(weights: str) -> int | None:
    """``neuzip-lossy-3`` -> 3; ``neuzip-lossless``/``dense`` -> None.

    Example:
        >>> mantissa_bits_of("neuzip-lossy-1"), mantissa_bits_of("neuzip-lossless")
        (1, None)
    """
    match = LOSSY.match(weights or "")
    return int(match.group(1)) if match else None


def build_weights_for(weights: str) -> str:
    """The weights mode a model is built with before :func:`compress_model_for_adapters` (lossy: lossless first)."""
    return "neuzip-lossless" if mantissa_bits_of(weights) is not None else weights


def is_peft_model(model) -> bool:
    """True for a peft ``PeftModel`` (checked without importing peft)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def compress_model_for_adapters(model: torch.nn.Module, weights: str, codec_options: dict | None = None) -> torch.nn.Module:
    """Make ``model`` a frozen base in ``weights`` form, in place; returns it.

    A dense model is compressed (``neuzip-*``); a lossless compressed model is
    re-rounded to k mantissa bits (``neuzip-lossy-<k>``), one matrix at a time.
    Every parameter is frozen. ``codec_options`` go to :func:`neutrain.compress.compress`.
    """
    from neutrain.compress import compress
    from neutrain.nn import compress_model, compressed_weights

    model.requires_grad_(False)
    k = mantissa_bits_of(weights)
    if weights == "dense":
        return model
    if not compressed_weights(model):
        compress_model(model, "neuzip-lossless", mantissa_bits=k, progress=False, codec_options=codec_options)
    elif k is not None:
        for weight in compressed_weights(model):
            if weight.ct.layout.lossless:
                weight.replace_(compress(weight.dense(), k, name=weight.name, **(codec_options or {})))
    for weight in compressed_weights(model):
        weight.key.requires_grad_(False)
    return model


def lora_target_modules(model: torch.nn.Module, target: str | list[str]) -> list[str] | str:
    """peft target modules; ``all-linear`` means every linear layer but the output head, compressed ones included.

    peft's own ``all-linear`` only recognises ``nn.Linear``, so it is expanded here to module-name suffixes.
    Any other target is checked against the model's linear layers as peft matches it (a name: a suffix of a
    module's dotted name; a single string: a regular expression over the whole name), and refused naming
    ``memory.lora_target_modules`` where a name matches no linear layer. Why: a misspelt name ended in peft's
    traceback when nothing matched, and silently left that layer untrained when another name did.
    """
    from neutrain.nn import CompressedLinear

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linear = [name for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, CompressedLinear))]
    suffixes = sorted({name.rpartition(".")[2] for name, m in model.named_modules()
                       if isinstance(m, (torch.nn.Linear, CompressedLinear)) and m is not head})
    if target == "all-linear":
        return suffixes
    key, known = "memory.lora_target_modules", f"the model's linear layers are {', '.join(suffixes) or 'none'}"
    if isinstance(target, str):
        try:
            pattern = re.compile(target)
        except (re.error, RecursionError, OverflowError) as exc:
            raise RecipeError(f"{key}: {target!r} is not a regular expression ({exc}); {known}") from None
        if not any(pattern.fullmatch(name) for name in linear):
            raise RecipeError(f"{key}: {target!r} (a regular expression over whole module names) matches no linear "
                              f"layer; {known}, or give 'all-linear'")
        return target
    if not target:
        raise RecipeError(f"{key}: an empty list adapts nothing; {known}, or give 'all-linear'")
    for wanted in target:
        if not any(name == wanted or name.endswith("." + wanted) for name in linear):
            raise RecipeError(f"{key}: '{wanted}' names no linear layer of the model; {known}, or give 'all-linear'")
    return target


def _compressed_lora_linear():
    """peft's LoRA ``Linear`` for a :class:`CompressedLinear` base (built lazily: peft is imported on use)."""
    from peft.tuners.lora.layer import Linear

    class CompressedLoraLinear(Linear):
        """LoRA over a compressed linear: device and dtype come from the codec, never from a decoded copy."""

        def _get_base_layer_device_and_dtype(self, base_layer):
            return base_layer.compressed.device, base_layer.compressed.dtype

    return CompressedLoraLinear


def apply_lora(model: torch.nn.Module, memory: Mapping[str, Any]):
    """Wrap ``model`` with peft LoRA adapters as the recipe's ``memory`` section says; returns the ``PeftModel``.

    Args:
        model: A causal LM, dense or with (frozen) compressed modules.
        memory: The :class:`~neutrain.config.MemorySection`, or a mapping of some of its keys (the schema's
            defaults fill in the rest): ``lora_r``, ``lora_alpha``, ``lora_dropout``, ``lora_target_modules``.

    Example:
        >>> peft_model = apply_lora(model, {"lora_r": 8, "lora_alpha": 16, "lora_target_modules": "all-linear"})  # doctest: +SKIP
    """
    from peft import LoraConfig, get_peft_model

    from neutrain.compat.quiet import peft_wrapping
    from neutrain.nn import CompressedLinear
    from neutrain.nn.stand_in import shape_only_weights

    m = section_from("memory", memory)
    config = LoraConfig(
        r=m.lora_r, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout, task_type="CAUSAL_LM",
        target_modules=lora_target_modules(model, m.lora_target_modules),
    )
    register_custom_lora_module(config, CompressedLinear, _compressed_lora_linear())
    with warnings.catch_warnings(), shape_only_weights(), peft_wrapping():
        # peft warns about any layer type it does not know; CompressedLinear is handled above.
        warnings.filterwarnings("ignore", message="Unsupported layer type")
        # peft reads each wrapped layer's .weight for its device only: no decode (neutrain.nn.stand_in).
        return get_peft_model(model, config)


def adapter_state_dict(model) -> dict[str, torch.Tensor]:
    """The trainable (adapter) parameters of a ``PeftModel`` by state-dict name, for ``save_pretrained``.

    Why not ``model.state_dict()``: with a compressed base that would clone every codec blob only for
    peft to keep the ``lora_`` entries.
    """
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def load_adapters(base_model: torch.nn.Module, adapter_dir, is_trainable: bool = False):
    """Attach LoRA adapters saved by ``save_pretrained`` (or a neutrain checkpoint) to ``base_model``.

    Works for compressed bases too (peft alone would refuse :class:`CompressedLinear` targets).

    Example:
        >>> peft_model = load_adapters(base, "outputs/run/checkpoint-100")  # doctest: +SKIP
    """
    from peft import LoraConfig, PeftModel

    from neutrain.compat.quiet import peft_wrapping
    from neutrain.nn import CompressedLinear
    from neutrain.nn.stand_in import shape_only_weights

    config = LoraConfig.from_pretrained(str(adapter_dir))
    register_custom_lora_module(config, CompressedLinear, _compressed_lora_linear())
    with warnings.catch_warnings(), shape_only_weights(), peft_wrapping():
        warnings.filterwarnings("ignore", message="Unsupported layer type")
        return PeftModel.from_pretrained(base_model, str(adapter_dir), config=config, is_trainable=is_trainable)
