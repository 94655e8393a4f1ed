"""Building the model and tokenizer a recipe's ``model`` section describes.

The model comes from a local Hugging Face directory or a hub id (read from the
local cache only, never downloaded at run time), or is built from a config
with random weights (``init: random``) for shape-only runs and for the default
recipe, which has no weights at hand.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from neutrain.errors import RecipeError

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, use_cpu: bool = False) -> torch.dtype:
    """``auto`` is bf16 on a GPU and fp32 on the CPU (bf16 matmuls are slow on most CPUs)."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() and not use_cpu else torch.float32
    return _DTYPES[name]


def build_tokenizer(model_cfg: dict[str, Any], data_cfg: dict[str, Any], output_dir: str, cache_dir: str):
    """Load or build the tokenizer, and save it under ``<output_dir>/tokenizer``.

    A tokenizer already saved there is reused, so a resumed run sees exactly the
    vocabulary it started with.
    """
    from transformers import AutoTokenizer

    from neutrain.data import byte_tokenizer, iter_training_texts, train_bpe_tokenizer

    saved = Path(output_dir) / "tokenizer"
    name = model_cfg["tokenizer"] or model_cfg["base_model"]
    if name in ("byte", "train-bpe") and (saved / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(saved))
    if name == "byte":
        tok = byte_tokenizer()
    elif name == "train-bpe":
        tok = train_bpe_tokenizer(iter_training_texts(data_cfg, cache_dir), vocab_size=model_cfg["tokenizer_vocab_size"])
    else:
        try:
            tok = AutoTokenizer.from_pretrained(name, trust_remote_code=model_cfg["trust_remote_code"])
        except Exception as exc:
            raise RecipeError(f"model.tokenizer: cannot load tokenizer '{name}' from a local path or the hub cache ({type(exc).__name__})") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if name in ("byte", "train-bpe"):
        tmp = saved.with_name(f"tokenizer.tmp{os.getpid()}")
        tok.save_pretrained(str(tmp))
        if not saved.exists():
            os.replace(tmp, saved)
        else:  # another process saved it first
            shutil.rmtree(tmp, ignore_errors=True)
    return tok


def _model_config(model_cfg: dict[str, Any], tokenizer):
    from transformers import AutoConfig

    cfg = model_cfg["config"]
    if cfg is None:
        config = AutoConfig.from_pretrained(model_cfg["base_model"], trust_remote_code=model_cfg["trust_remote_code"])
    else:
        if isinstance(cfg, str):
            cfg = json.loads(Path(cfg).read_text())
        cfg = dict(cfg)
        model_type = cfg.pop("model_type", None)
        if not model_type:
            raise RecipeError("model.config: needs a 'model_type' (e.g. llama)")
        try:
            config = AutoConfig.for_model(model_type, **cfg)
        except ValueError as exc:
            raise RecipeError(f"model.config.model_type: {exc}") from None
    explicit_vocab = isinstance(model_cfg["config"], dict) and "vocab_size" in model_cfg["config"]
    if model_cfg["tokenizer"] in ("byte", "train-bpe") and not explicit_vocab:
        config.vocab_size = len(tokenizer)
    if config.vocab_size < len(tokenizer):
        raise RecipeError(f"model.config.vocab_size: {config.vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
    for attr in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            setattr(config, attr, value)
    return config


def config_only(model_cfg: dict[str, Any]):
    """The model config a recipe describes, without loading weights or a tokenizer (for the planner)."""
    from transformers import AutoConfig

    if model_cfg["config"] is None:
        return AutoConfig.from_pretrained(model_cfg["base_model"], trust_remote_code=model_cfg["trust_remote_code"])

    class _Vocab:  # stands in for a tokenizer built at train time
        def __len__(self):
            return 259 if model_cfg["tokenizer"] == "byte" else model_cfg["tokenizer_vocab_size"]

    return _model_config(model_cfg, _Vocab())


def _build_compressed(model_cfg, tokenizer, weights, dtype, attn, use_cpu, seed):
    """Build straight into NeuZip form, one tensor at a time, on the training device.

    The dense model is never materialised: random init draws each tensor and encodes
    it at once; a checkpoint is read tensor by tensor from safetensors. With ``dtype: auto``
    on CPU the weights are stored bf16 (what NeuZip compresses well) and computed in fp32
    (bf16 matrix products are ~12x slower there).
    """
    from neutrain.nn.load import init_compressed, load_compressed

    device = "cuda" if torch.cuda.is_available() and not use_cpu else "cpu"
    storage = torch.bfloat16 if model_cfg["dtype"] == "auto" and dtype == torch.float32 else None
    if model_cfg["init"] == "random":
        config = _model_config(model_cfg, tokenizer)
        config._attn_implementation = attn
        model, report = init_compressed(config, weights, device, dtype=dtype, seed=seed, storage_dtype=storage)
    else:
        try:
            model, report = load_compressed(model_cfg["base_model"], weights, device, dtype=dtype,
                                            config_overrides={"_attn_implementation": attn}, storage_dtype=storage)
        except OSError as exc:
            raise RecipeError(f"model.base_model: cannot load '{model_cfg['base_model']}' ({str(exc).splitlines()[0]})") from None
    logger.info("compressed model: %s", report)
    return model


def build_model(model_cfg: dict[str, Any], tokenizer, use_cpu: bool = False, seed: int = 42, weights: str = "dense"):
    """Build the causal LM described by ``model_cfg``, dense or NeuZip-compressed (``weights``).

    Example:
        >>> from neutrain.config import load_recipe
        >>> from neutrain.data import byte_tokenizer
        >>> model = build_model(load_recipe("default").model, byte_tokenizer(), use_cpu=True)
        >>> type(model).__name__
        'LlamaForCausalLM'
    """
    from transformers import AutoModelForCausalLM

    dtype = resolve_dtype(model_cfg["dtype"], use_cpu)
    from neutrain.nn.architecture import auto_attention, check_attention

    try:
        architecture = config_only(model_cfg)
    except OSError as exc:
        raise RecipeError(f"model.base_model: cannot load the config of '{model_cfg['base_model']}' from a local "
                          f"path or the hub cache ({str(exc).splitlines()[0]})") from None
    attn = model_cfg["attn_implementation"]
    if attn == "auto":  # what the architecture supports; SageAttention where measured faster, per call
        attn = auto_attention(architecture, cuda=torch.cuda.is_available() and not use_cpu)
    if attn == "neutrain_sage" and auto_attention(architecture, cuda=True) != "neutrain_sage":
        attn = auto_attention(architecture, cuda=False)  # sdpa, or eager where the architecture has none
        logger.warning("model.attn_implementation: this architecture takes no registered attention function; "
                       "using %s", attn)
    if attn == "neutrain_sage" and (use_cpu or not torch.cuda.is_available()):
        # The INT8/FP8 kernels need a CUDA GPU; on CPU the quantized torch reference would only
        # be slower than SDPA, so a recipe that asks for SageAttention trains with SDPA there.
        attn = auto_attention(architecture, cuda=False)  # sdpa, or eager where the architecture has none
        logger.warning("model.attn_implementation: neutrain_sage needs a CUDA GPU; using %s on CPU", attn)
    check_attention(architecture, attn)
    if attn == "neutrain_sage":
        from neutrain.attention import register

        attn = register()
    if weights != "dense":
        return _build_compressed(model_cfg, tokenizer, weights, dtype, attn, use_cpu, seed)
    if model_cfg["init"] == "random":
        config = _model_config(model_cfg, tokenizer)
        torch.manual_seed(seed)  # the same random weights on every process and every resume
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                model_cfg["base_model"], dtype=dtype, attn_implementation=attn,
                trust_remote_code=model_cfg["trust_remote_code"],
            )
        except OSError as exc:
            raise RecipeError(f"model.base_model: cannot load '{model_cfg['base_model']}' from a local path or the hub cache ({str(exc).splitlines()[0]})") from None
    n = sum(p.numel() for p in model.parameters())
    logger.info("model: %s, %.1fM parameters, %s, attention %s", type(model).__name__, n / 1e6, dtype, attn)
    return model
