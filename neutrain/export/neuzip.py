"""NeuZip export: compressed safetensors that ``from_pretrained`` loads compressed.

Layout of an export directory::

    config.json                 the model config plus quantization_config {"quant_method": "neuzip", ...}
    generation_config.json
    model-0000k-of-0000n.safetensors + model.safetensors.index.json   (or model.safetensors)
    tokenizer files, README.md (model card), neutrain_export.json

Each compressed matrix ``<module>.weight`` is stored as the codec's sealed
blobs ``<module>.weight.{header,code_lengths,lane_words,tile_base,stream,tails,
checksum,name}`` (:mod:`neutrain.compress.format`); norms and biases stay dense.
A one-byte ``<module>.weight`` tensor marks every compressed matrix: it has
the wrong shape for the dense layer on purpose, so that loading the export
*without* neutrain's quantizer registered fails with transformers' size
mismatch error instead of silently building a dense model of random weights
(see :mod:`neutrain.export.quantizer`).

Lossless export of a NeuZip-trained model writes its compressed tensors as
they are (no re-encode), so the export decodes bit-exactly to the trained
weights. ``neuzip-lossy-<k>`` rounds every matrix to ``k`` mantissa bits
(docs/codec.md §1, lossy NeuZip): for inference and frozen bases only.

Example:
    >>> from neutrain.export.neuzip import export_neuzip
    >>> export_neuzip(model, "out/neuzip", mantissa_bits=None)           # doctest: +SKIP
    >>> import neutrain, transformers
    >>> transformers.AutoModelForCausalLM.from_pretrained("out/neuzip")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from neutrain.config.schema import ExportSection
from neutrain.storage.manifest import write_manifest
from neutrain.compress import compress
from neutrain.compress.layout import LOSSY_MANTISSA_BITS
from neutrain.errors import UserInputError
from neutrain.export.hf import training_facts
from neutrain.export.target import EXPORT_INFO, check_export_target, staged_export
from neutrain.nn.convert import default_targets
from neutrain.nn.weight_offload_model import write_safetensors as write_one_file
from neutrain.optim.weight_io import COMPRESSED_KEY_ATTR

MARKER_SUFFIX = ".weight"
"""The one-byte marker tensor sits at the dense weight's own name (see the module docstring)."""
_FORMAT = re.compile(r"^neuzip(?:-lossless|-lossy-(\d+))?$")


def parse_format(fmt: str) -> int | None:
    """Mantissa bits of a NeuZip format string: ``neuzip``/``neuzip-lossless`` -> None, ``neuzip-lossy-3`` -> 3.

    Raises:
        UserInputError: for anything else, or a k the codec does not offer.

    Example:
        >>> parse_format("neuzip"), parse_format("neuzip-lossy-3")
        (None, 3)
    """
    match = _FORMAT.match(fmt or "")
    if match is None:
        raise UserInputError(f"format '{fmt}': expected neuzip, neuzip-lossless or neuzip-lossy-<k>")
    if match.group(1) is None:
        return None
    k = int(match.group(1))
    if k not in LOSSY_MANTISSA_BITS:
        raise UserInputError(f"format '{fmt}': k must be one of {', '.join(map(str, LOSSY_MANTISSA_BITS))}")
    return k


def compressed_state(model: torch.nn.Module, mantissa_bits: int | None, codec_options: dict | None = None):
    """``(state, compressed_names)``: every tensor to save, and the names of the compressed modules.

    Compressed modules of ``model`` keep their own bytes when the export is
    lossless; dense ``nn.Linear``/``nn.Embedding`` targets are encoded one at a
    time (peak: one dense copy). A lossy export re-rounds every matrix.
    """
    targets = set(default_targets(model))
    state: dict[str, torch.Tensor] = {}
    names: list[str] = []
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        compressed = getattr(module, "compressed", None)
        if name in targets or compressed is not None:
            ct = compressed.saved_ct() if compressed is not None else None  # offloaded: the host copy
            # The model's own blobs stay views, copied to the host one by one as the file is written; a
            # re-encoded tensor goes to the host at once, so the device holds one of them at a time.
            move = "cpu" if ct is None or mantissa_bits is not None or not ct.layout.lossless else None
            if move:
                dense = compressed.dense() if compressed is not None else module.weight.detach()
                ct = compress(dense, mantissa_bits, name=prefix + "weight", **(codec_options or {}))
                del dense
            for key, blob in ct.state_dict().items():
                state[f"{prefix}weight.{key}"] = blob.to(move) if move else blob
            del ct
            state[prefix + "weight"] = torch.zeros(1, dtype=torch.uint8)  # the marker
            if getattr(module, "bias", None) is not None:
                state[prefix + "bias"] = module.bias.detach().cpu().contiguous()
            names.append(name)
            continue
        # MoE expert stacks are written dense, as a dense model's are (transformers loads them as they are).
        for pname, weight in module.__dict__.get("compressed_params", {}).items():
            state[prefix + pname] = weight.dense().to(weight.compute_dtype).cpu()
        for pname, p in module.named_parameters(recurse=False):
            if not getattr(p, COMPRESSED_KEY_ATTR, False):
                state[prefix + pname] = p.detach().cpu().contiguous()
        for bname, b in module.named_buffers(recurse=False):
            if bname not in module._non_persistent_buffers_set:
                state[prefix + bname] = b.detach().cpu().contiguous()
    return state, names


def parse_size(size: str | int) -> int:
    """Bytes in ``"5GB"``, ``"500MB"``, ``"100KB"`` (decimal units, as transformers) or an int.

    Example:
        >>> parse_size("500MB")
        500000000
    """
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", str(size).upper())
    if match is None:
        raise UserInputError(f"max_shard_size '{size}': expected e.g. 500MB or 5GB")
    unit = match.group(2)
    base = 1024 if "I" in unit else 1000
    return int(float(match.group(1)) * base ** "BKMGT".index(unit[0] if unit != "B" else "B"))


def _shards(state: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most ``max_bytes`` (a larger tensor gets a shard of its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    return shards


def write_safetensors(state: dict[str, torch.Tensor], directory: Path, max_shard_size: str) -> None:
    """``model.safetensors``, or numbered shards plus ``model.safetensors.index.json`` (transformers' names).

    Each file is written tensor by tensor (``save_file`` would first build the whole shard's bytes).
    """
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

    shards = _shards(state, parse_size(max_shard_size))
    if len(shards) == 1:
        write_one_file(shards[0], directory / SAFE_WEIGHTS_NAME, {"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        write_one_file(shard, directory / fname, {"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2))


def _model_card(model, mantissa_bits: int | None, info: dict) -> str:
    mode = "lossless (bit-exact)" if mantissa_bits is None else f"lossy, {mantissa_bits} mantissa bits"
    return "\n".join([
        "---", "library_name: transformers", "tags: [neutrain, neuzip, causal-lm]", "---",
        f"# {info.get('name', 'neutrain NeuZip export')}", "",
        f"A {type(model).__name__} exported by neutrain with NeuZip-compressed weights, {mode}.", "",
        *(["## Training", *facts, ""] if (facts := training_facts(info)) else []),
        "## Use", "",
        "`import neutrain` registers the `neuzip` quantizer with transformers; without it this folder",
        "does not load (transformers reports a size mismatch for every compressed weight).", "",
        "```python", "import neutrain  # registers quant_method 'neuzip'",
        "from transformers import AutoModelForCausalLM",
        "model = AutoModelForCausalLM.from_pretrained('<this directory>')  # weights stay compressed",
        "```", "",
        "A dense copy: `neutrain export <checkpoint> --format hf`.", "",
    ])


def export_neuzip(model, output_dir: str | os.PathLike, *, mantissa_bits: int | None = None, tokenizer=None,
                  max_shard_size: str = ExportSection().max_shard_size, info: dict | None = None, codec_options: dict | None = None,
                  overwrite: bool = False) -> str:
    """Write a NeuZip export of ``model`` (dense or compressed) into ``output_dir``, atomically.

    Args:
        model: A transformers causal LM, dense or converted by :func:`neutrain.compress_model`.
        output_dir: Target directory; written atomically (:mod:`neutrain.export.target`).
        mantissa_bits: None for lossless; 0, 1, 3 or 7 for lossy.
        tokenizer: Saved beside the weights when given.
        max_shard_size: Largest safetensors shard.
        info: Facts for ``neutrain_export.json`` and the model card.
        codec_options: Extra arguments for :func:`neutrain.compress.compress`.
        overwrite: Replace a previous neutrain export at ``output_dir``; anything else there is always refused.

    Returns:
        The export directory.

    Example:
        >>> export_neuzip(model, "out/neuzip-lossy-3", mantissa_bits=3)  # doctest: +SKIP
    """
    check_export_target(output_dir, overwrite)  # before the (long) encoding
    state, names = compressed_state(model, mantissa_bits, codec_options)
    if not names:
        raise UserInputError("NeuZip export: the model has no linear or embedding weights to compress")
    with staged_export(output_dir, overwrite) as tmp:
        _write_export(tmp, model, state, names, mantissa_bits, tokenizer, max_shard_size, info)
    return str(output_dir)


def _write_export(tmp: Path, model, state: dict, names: list[str], mantissa_bits: int | None, tokenizer,
                  max_shard_size: str, info: dict | None) -> None:
    from transformers import GenerationConfig

    # lazy: a cycle at import time. The quantizer's first import imports transformers.quantizers.auto,
    # whose registration hook (export/registration.py) imports the quantizer back half-initialised.
    from neutrain.export.quantizer import NeuZipConfig

    write_safetensors(state, tmp, max_shard_size)
    config = model.config.__class__.from_dict(model.config.to_dict())
    # Tied weights are written (and loaded) as two compressed tensors; the loader shares identical ones.
    config.tie_word_embeddings = False
    dtype = next((t.dtype for k, t in state.items() if k.endswith(".weight") and t.is_floating_point()), None)
    config.quantization_config = NeuZipConfig(mantissa_bits=mantissa_bits, modules=names).to_dict()
    config.save_pretrained(str(tmp))
    if dtype is not None:  # the dense tensors' dtype, for dtype="auto" loading
        raw = json.loads((tmp / "config.json").read_text())
        raw["dtype"] = str(dtype).replace("torch.", "")
        (tmp / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True))
    gen = getattr(model, "generation_config", None) or GenerationConfig.from_model_config(model.config)
    gen.save_pretrained(str(tmp))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    (tmp / "README.md").write_text(_model_card(model, mantissa_bits, info or {}))
    fmt = "neuzip" if mantissa_bits is None else f"neuzip-lossy-{mantissa_bits}"
    (tmp / EXPORT_INFO).write_text(json.dumps({"format": fmt, **(info or {})}, indent=2, default=str))
    write_manifest(tmp)  # last: checksums of everything above
