"""LoRA adapters at export time: folding them into the base, and loading an adapter checkpoint with its base.

The adapters themselves (peft layers over :class:`~neutrain.nn.CompressedLinear`) live in
:mod:`neutrain.nn.lora`; folding them back needs the dense export path
(:func:`neutrain.export.hf.densify`), so it sits here, one layer up.

Example:
    >>> from neutrain.export.lora import merge_lora
    >>> merged = merge_lora(peft_model, "neuzip-lossless")  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoTokenizer

from neutrain.compress import compress
from neutrain.errors import CheckpointError
from neutrain.files import read_json_object
from neutrain.export.hf import densify, load_checkpoint_model
from neutrain.nn import CompressedLinear, CompressedWeight
from neutrain.nn.lora import load_adapters, mantissa_bits_of
from neutrain.storage.fingerprint import model_fingerprint
from neutrain.storage.manifest import verify_checkpoint

logger = logging.getLogger("neutrain")


def _merged_weight(layer) -> torch.Tensor:
    """Base weight plus the active adapters' deltas, added in fp32 and rounded once to the weight's dtype."""
    base = layer.get_base_layer()
    dense = base.compressed.dense() if hasattr(base, "compressed") else base.weight.detach()
    total = dense.float()
    for name in layer.active_adapters:
        if name in layer.lora_A:
            total += layer.get_delta_weight(name).float().to(total.device)
    return total.to(dense.dtype)


def merge_lora(model, weights: str = "dense", codec_options: dict | None = None) -> torch.nn.Module:
    """Fold the LoRA adapters of a ``PeftModel`` into its base; returns the plain transformers model.

    Args:
        model: A ``PeftModel`` from :func:`apply_lora` (or peft's loading).
        weights: ``dense`` (every weight decoded, a plain bf16/fp32 model), ``neuzip-lossless`` (merged
            matrices compressed bit-exactly, other compressed modules kept as they are) or
            ``neuzip-lossy-<k>`` (merged matrices rounded to k mantissa bits).
        codec_options: Extra arguments for :func:`neutrain.compress.compress`.

    Example:
        >>> merged = merge_lora(peft_model, "neuzip-lossless")  # doctest: +SKIP
    """
    from peft.tuners.lora import LoraLayer  # lazy: peft is an optional dependency

    if weights != "dense" and not weights.startswith("neuzip"):
        raise ValueError(f"weights must be dense, neuzip-lossless or neuzip-lossy-<k>, not {weights!r}")
    k = mantissa_bits_of(weights)
    base_model = model.get_base_model()
    for name, layer in list(base_model.named_modules()):
        if not isinstance(layer, LoraLayer):
            continue
        if getattr(layer, "use_dora", {}) and any(layer.use_dora.values()):
            raise ValueError("merge_lora: DoRA adapters are not supported")
        base = layer.get_base_layer()
        merged = _merged_weight(layer)
        bias = base.bias
        if weights == "dense":
            new = torch.nn.Linear(merged.shape[1], merged.shape[0], bias=bias is not None, device="meta")
            new.weight = torch.nn.Parameter(merged, requires_grad=False)
            if bias is not None:
                new.bias = bias
        else:
            ct = compress(merged, k, name=f"{name}.weight", **(codec_options or {}))
            new = CompressedLinear(CompressedWeight(ct, requires_grad=False, name=f"{name}.weight"), bias=bias)
        base_model.set_submodule(name, new)
        del merged
    if "peft_config" in base_model.__dict__:
        del base_model.peft_config  # a plain transformers model again
    if weights == "dense":
        base_model = densify(base_model)
    return base_model.eval()


def adapter_base(path, base: str | None = None) -> str | None:
    """The base model an adapter checkpoint ``path`` is merged onto: ``base``, else the one its adapter config names,
    else the ``<output_dir>/base`` its run wrote; None when none is named."""
    path = Path(path)
    adapter_config = path / "adapter_config.json"
    base = base or read_json_object(adapter_config, f"checkpoint file '{adapter_config}'",
                                    CheckpointError).get("base_model_name_or_path")
    if not base and (path.parent / "base" / "config.json").exists():
        base = str(path.parent / "base")  # a run with no base directory wrote its frozen base there (cli/train.py)
    return base


def load_adapter_checkpoint(path, base: str | None = None, dtype: str = "auto", force_base: bool = False,
                            key: str = "--base"):
    """``(peft_model, tokenizer)`` for an adapter checkpoint: its base (``base`` or the adapter config's) plus adapters.

    The base is checked against the one the adapters were trained on (:func:`check_adapter_base`), and, when
    neutrain wrote it, against its manifest.

    Raises:
        CheckpointError: when no base model directory is known, or the base is not the adapters' own (unless
            ``force_base``).
    """
    path = Path(path)
    verify_checkpoint(path)
    base = adapter_base(path, base)
    if not base or not Path(base).is_dir():
        raise CheckpointError(f"adapter checkpoint '{path}': its base model directory is unknown or missing "
                              f"({base!r}); pass --base DIR")
    fingerprint = check_adapter_base(path, base, force_base, key)
    model, tokenizer = load_checkpoint_model(base, dtype=dtype)
    if tokenizer is None and (path / "tokenizer_config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = load_adapters(model, path)
    model.neutrain_base = {"path": str(base), "fingerprint": fingerprint}  # what an export of it records
    return model, tokenizer


RUN_RECORD = "neutrain_run.json"  # written into every checkpoint by neutrain.trainer.resume_check
BASE_KEY = "model.base"


def recorded_base(checkpoint) -> str | None:
    """The fingerprint of the base an adapter checkpoint's run trained on, as its record holds it (None: not recorded)."""
    path = Path(checkpoint) / RUN_RECORD
    try:
        value = read_json_object(path, f"checkpoint file '{path}'", CheckpointError)["record"].get(BASE_KEY)
    except (CheckpointError, KeyError, TypeError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def check_adapter_base(checkpoint, base, force: bool = False, key: str = "--base") -> str:
    """Refuse a ``base`` that is not the model the adapters of ``checkpoint`` were trained on; returns its fingerprint.

    Why: merged onto another model (another vocabulary and tokenizer even) the adapters gave an export that
    generated garbage, and nothing was recorded. ``force`` (``neutrain export --force-base``) merges anyway,
    with a warning, and the export records the base it was given.
    """
    now = model_fingerprint(base)
    recorded = recorded_base(checkpoint)
    if recorded is None:
        logger.warning("adapter checkpoint '%s' records no base (written before neutrain recorded one): the base "
                       "'%s' cannot be checked against the one its adapters were trained on", checkpoint, base)
    elif recorded != now and not force:
        raise CheckpointError(
            f"{key} '{base}' is not the base adapter checkpoint '{checkpoint}' was trained on (by content: trained on "
            f"{recorded[:24]}..., this one is {now[:24]}...): merged onto another model its adapters give a broken "
            f"model. Give the run's own base, or pass --force-base to merge anyway")
    elif recorded != now:
        logger.warning("--force-base: merging the adapters of %s onto '%s', which is not the base they were trained "
                       "on; the export records it", checkpoint, base)
    return now
