"""Dense Hugging Face export: sharded safetensors, configs, tokenizer and a model card.

The export is written to a temporary directory and renamed into place, so an
interrupted export never leaves a half-written model behind. The result loads
with plain ``AutoModelForCausalLM.from_pretrained`` and no neutrain import.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from neutrain.config.errors import CheckpointError

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def load_checkpoint_model(path: str | os.PathLike, dtype: str = "auto"):
    """Load a ``checkpoint-N`` (or export) directory as a causal LM and its tokenizer.

    Raises:
        CheckpointError: if the directory is missing or incomplete.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint '{path}' does not exist or is not a directory")
    if not (path / "config.json").exists():
        raise CheckpointError(f"checkpoint '{path}' has no config.json (is it a checkpoint-N directory?)")
    weights = list(path.glob("*.safetensors")) + list(path.glob("*.safetensors.index.json"))
    if not weights:
        raise CheckpointError(f"checkpoint '{path}' has no safetensors weights")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype="auto" if dtype == "auto" else _DTYPES[dtype])
    except Exception as exc:
        raise CheckpointError(f"checkpoint '{path}': cannot load the model ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    tokenizer = None
    for cand in (path, path.parent / "tokenizer"):
        if (cand / "tokenizer_config.json").exists():
            tokenizer = AutoTokenizer.from_pretrained(str(cand))
            break
    return model, tokenizer


def _model_card(model, info: dict[str, Any]) -> str:
    n = sum(p.numel() for p in model.parameters())
    lines = [
        "---",
        "library_name: transformers",
        "tags: [neutrain, causal-lm]",
        "---",
        f"# {info.get('name', 'neutrain export')}",
        "",
        f"A {type(model).__name__} with {n / 1e6:.1f}M parameters, fine-tuned with neutrain and exported as dense "
        f"{str(model.dtype).replace('torch.', '')} safetensors.",
        "",
        "## Training",
    ]
    for key in ("base_model", "recipe", "steps", "final_loss", "heldout_perplexity"):
        if info.get(key) is not None:
            lines.append(f"- {key.replace('_', ' ')}: {info[key]}")
    lines += [
        "",
        "## Use",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "model = AutoModelForCausalLM.from_pretrained('<this directory>')",
        "tokenizer = AutoTokenizer.from_pretrained('<this directory>')",
        "```",
        "",
    ]
    return "\n".join(lines)


def export_hf(model, output_dir: str | os.PathLike, tokenizer=None, max_shard_size: str = "5GB", dtype: str = "auto", info: dict | None = None) -> str:
    """Write a dense Hugging Face model directory.

    Args:
        model: A causal LM (dense).
        output_dir: Target directory (replaced atomically if it exists).
        tokenizer: Saved beside the weights when given.
        max_shard_size: Largest safetensors shard (``"5GB"``); larger models are sharded with an index.
        dtype: ``auto`` keeps the weights' own dtype (bit-identical logits); or bfloat16/float32/float16.
        info: Facts for the model card (base_model, recipe, steps, final_loss, heldout_perplexity).

    Returns:
        The export directory.

    Example:
        >>> export_hf(model, "outputs/run/export", tokenizer, max_shard_size="500MB")
    """
    from transformers import GenerationConfig

    out = Path(output_dir)
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if dtype != "auto" and model.dtype != _DTYPES[dtype]:
        model = model.to(_DTYPES[dtype])
    model.save_pretrained(str(tmp), max_shard_size=max_shard_size, safe_serialization=True)
    gen = getattr(model, "generation_config", None) or GenerationConfig.from_model_config(model.config)
    gen.save_pretrained(str(tmp))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    (tmp / "README.md").write_text(_model_card(model, info or {}))
    (tmp / "neutrain_export.json").write_text(json.dumps({"format": "hf", **(info or {})}, indent=2, default=str))
    if out.exists():
        old = out.with_name(f".tmp-old-{out.name}-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)
    return str(out)
