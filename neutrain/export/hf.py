"""Dense Hugging Face export: sharded safetensors, configs, tokenizer and a model card.

The export is written to a temporary directory and renamed into place, so an
interrupted export never leaves a half-written model behind. The result loads
with plain ``AutoModelForCausalLM.from_pretrained`` and no neutrain import.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch

from neutrain.config.schema import ExportSection
from neutrain.storage.manifest import write_manifest
from neutrain.errors import CheckpointError, UserInputError
from neutrain.export.target import EXPORT_INFO, source_changed, staged_export
from neutrain.files import check_folder
from neutrain.nn import decompressed_state_dict
from neutrain.nn.checkpoint import is_compressed
from neutrain.nn.formats import folder_format
from neutrain.storage.manifest import verify_checkpoint

logger = logging.getLogger("neutrain")
_DEFAULTS = ExportSection()  # the recipe's export keys' defaults, also this API's

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def load_checkpoint_model(path: str | os.PathLike, dtype: str = "auto", verified: bool = False, *, folder=None):
    """Load a ``checkpoint-N`` (or export) directory as a causal LM and its tokenizer, on the CPU (eval mode).

    The folder's format loads it (:meth:`neutrain.nn.formats.ModelFormat.load_model`): a compressed run's
    checkpoint is rebuilt from its blobs as they are (no re-encoding), a dense checkpoint or export tensor by
    tensor (:func:`neutrain.nn.load.build`), a NeuZip export through transformers' ``from_pretrained`` and
    neutrain's quantizer, as any user of the export loads it; ``dtype`` ``auto`` keeps the dtype the weights
    are stored in. ``verified``: the caller
    ran :func:`~neutrain.storage.manifest.verify_checkpoint` on it already (its checksums read every byte).
    ``folder``: ``path`` as the caller already read it, its ``format`` (:mod:`neutrain.nn.formats`, with its
    config read; ``neutrain generate``'s placement holds it): neither is chosen or parsed again.

    Raises:
        CheckpointError: if the directory is missing or incomplete.
    """
    path = Path(path)
    if not verified:
        verify_checkpoint(path)  # checksums, and no file that would run code when loaded
    changed = source_changed(path)
    if changed:
        logger.warning("%s", changed)
    if not (path / "config.json").exists():
        raise CheckpointError(f"checkpoint '{path}' has no config.json (is it a checkpoint-N directory?)")
    weights = list(path.glob("*.safetensors")) + list(path.glob("*.safetensors.index.json"))
    if not weights:
        raise CheckpointError(f"checkpoint '{path}' has no safetensors weights")

    fmt = folder.format if folder is not None else folder_format(path)  # one format object answers for the folder
    try:
        model = fmt.load_model(None if dtype == "auto" else _DTYPES[dtype])
    except CheckpointError:
        raise  # names the file and what is wrong in it already
    except Exception as exc:
        raise CheckpointError(f"checkpoint '{path}': cannot load the model ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    return model, _load_tokenizer(path)


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    for cand in (path, path.parent / "tokenizer"):
        if (cand / "tokenizer_config.json").exists():
            check_folder(cand, f"tokenizer files in '{cand}'", CheckpointError)  # a FIFO there blocked the load
            try:
                return AutoTokenizer.from_pretrained(str(cand))
            except Exception as exc:  # a malformed tokenizer.json raises KeyError, ValueError, Rust's Exception...
                detail = " ".join(str(exc).split())[:200]
                raise CheckpointError(f"tokenizer files in '{cand}' cannot be loaded ({type(exc).__name__}: {detail}); "
                                      "restore them from the run's checkpoint or the base model") from None
    return None


def check_representable(model, dtype: torch.dtype | None) -> None:
    """Refuse to export weights that are not finite, or that ``dtype`` (None: their own) would turn into inf.

    Why: ``export --dtype float16`` of weights beyond 65504 wrote inf under a valid manifest, without a word,
    and a model whose weights held NaN exported as if it were fine. One reduction per tensor, on its device, with no
    temporary the size of the tensor (the export phase holds one weight at a time).

    Raises:
        UserInputError: naming the tensor, its largest magnitude and the dtype's limit.

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> with torch.no_grad():
        ...     _ = layer.weight.fill_(1e5)
        >>> check_representable(layer, torch.bfloat16)
        >>> check_representable(layer, torch.float16)
        Traceback (most recent call last):
        neutrain.errors.UserInputError: export as float16: weight 'weight' has values up to 1e+05, beyond float16's largest, 65504: they would be written as inf. Export as bfloat16 or float32
    """
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        low, high = (float(x) for x in torch.aminmax(tensor.detach()))  # NaN and inf show in the extremes
        if not (math.isfinite(low) and math.isfinite(high)):
            raise UserInputError(f"weight '{name}' holds NaN or inf: the model is broken (did the training diverge?), "
                                 f"and an export would pass it off as a model under a valid checksum")
        limit = torch.finfo(dtype or tensor.dtype).max
        largest = max(-low, high)
        if largest > limit:
            target = str(dtype).replace("torch.", "")
            raise UserInputError(f"export as {target}: weight '{name}' has values up to {largest:.3g}, beyond {target}'s "
                                 f"largest, {limit:.5g}: they would be written as inf. Export as bfloat16 or float32")


def densify(model):
    """A dense copy of a NeuZip-compressed model (on the CPU), bit-identical to the decoded weights.

    A dense model is returned as it is.
    """
    if not is_compressed(model):
        return model
    from transformers import AutoModelForCausalLM

    # Each weight goes to the host as soon as it is decoded: the device never holds the dense model.
    state = decompressed_state_dict(model, device="cpu")
    dtype = next(v.dtype for k, v in state.items() if k.endswith(".weight") and v.is_floating_point())
    with torch.device("meta"):
        dense = AutoModelForCausalLM.from_config(model.config, dtype=dtype)
    dense.load_state_dict(state, strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        dense.tie_weights()
    missing = [n for n, p in dense.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"densify: no decoded value for {missing[:4]}")
    for name, buf in model.named_buffers():  # rotary frequencies etc.
        parent, _, leaf = name.rpartition(".")
        getattr(dense.get_submodule(parent) if parent else dense, "_buffers")[leaf] = buf.detach().cpu()
    if getattr(model, "generation_config", None) is not None:
        dense.generation_config = model.generation_config
    return dense.eval()


CARD_FACTS = (("base_model", "base model"), ("distilled_from", "distilled from"), ("recipe", "recipe"),
              ("checkpoint", "checkpoint"), ("steps", "steps"), ("final_loss", "final training loss"),
              ("heldout_perplexity", "held-out perplexity"), ("acceptance", "acceptance rate alpha"))
"""The model card's "Training" facts, in order, as ``info`` keys and the words the card uses."""


def training_facts(info: dict[str, Any]) -> list[str]:
    """The card's "Training" lines for the facts ``info`` holds; none, and no section, when it holds none.

    Example:
        >>> training_facts({"steps": 240, "final_loss": 4.676325607, "name": "x"})
        ['- steps: 240', '- final training loss: 4.676']
    """
    lines = []
    for key, label in CARD_FACTS:
        value = info.get(key)
        if value is not None and value != "":
            lines.append(f"- {label}: {value:.4g}" if isinstance(value, float) else f"- {label}: {value}")
    return lines


def _model_card(model, info: dict[str, Any]) -> str:
    n = sum(p.numel() for p in model.parameters())
    lines = [
        "---",
        "library_name: transformers",
        "tags: [neutrain, causal-lm]",
        "---",
        f"# {info.get('name', 'neutrain export')}",
        "",
        f"A {type(model).__name__} with {n / 1e6:.1f}M parameters, trained with neutrain and exported as dense "
        f"{str(model.dtype).replace('torch.', '')} safetensors.",
        "",
    ]
    facts = training_facts(info)
    if facts:  # an empty heading read as a card whose writer forgot the run
        lines += ["## Training", *facts, ""]
    lines += [
        "## Use",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "model = AutoModelForCausalLM.from_pretrained('<this directory>')",
        "tokenizer = AutoTokenizer.from_pretrained('<this directory>')",
        "```",
        "",
    ]
    return "\n".join(lines)


def export_hf(model, output_dir: str | os.PathLike, tokenizer=None, max_shard_size: str = _DEFAULTS.max_shard_size,
              dtype: str = _DEFAULTS.dtype, info: dict | None = None, overwrite: bool = False) -> str:
    """Write a dense Hugging Face model directory.

    Args:
        model: A causal LM (dense).
        output_dir: Target directory; written atomically (:mod:`neutrain.export.target`).
        tokenizer: Saved beside the weights when given.
        max_shard_size: Largest safetensors shard (``"5GB"``); larger models are sharded with an index.
        dtype: ``auto`` keeps the weights' own dtype (bit-identical logits); or bfloat16/float32/float16.
        info: Facts for the model card (base_model, recipe, steps, final_loss, heldout_perplexity).
        overwrite: Replace a previous neutrain export at ``output_dir``; anything else there is always refused.

    Returns:
        The export directory.

    Example:
        >>> import os, tempfile
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from neutrain.data import byte_tokenizer
        >>> tokenizer = byte_tokenizer()
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        ...                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        >>> with tempfile.TemporaryDirectory() as out:
        ...     path = export_hf(model, f"{out}/export", tokenizer, max_shard_size="500MB")
        ...     os.path.isfile(os.path.join(path, "config.json"))
        True
    """
    from transformers import GenerationConfig

    with staged_export(output_dir, overwrite) as tmp:  # refuses a target that is not a previous export first
        model = densify(model)
        check_representable(model, None if dtype == "auto" else _DTYPES[dtype])
        if dtype != "auto" and model.dtype != _DTYPES[dtype]:
            model = model.to(_DTYPES[dtype])
        model.save_pretrained(str(tmp), max_shard_size=max_shard_size, safe_serialization=True)
        gen = getattr(model, "generation_config", None) or GenerationConfig.from_model_config(model.config)
        gen.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        (tmp / "README.md").write_text(_model_card(model, info or {}))
        (tmp / EXPORT_INFO).write_text(json.dumps({"format": "hf", **(info or {})}, indent=2, default=str))
        write_manifest(tmp)  # last: checksums of everything above
    return str(output_dir)
