"""A model's shape read straight from a recipe's ``model.config`` (or a local base model's ``config.json``).

Why without transformers: the memory planner (``neutrain estimate``) needs eight numbers of a config, and
building the config class to get them imported transformers' config machinery, and torch behind it: five
of the estimate's seven seconds on a 2-core CPU. Where the mapping itself holds every number the planner
reads, and the architecture derives the rest the one way :data:`DERIVED_HEAD_DIM` names, the numbers are
read here; anything else (another architecture, a key missing, a value of another type, a hub id) returns
None, and the config class is built as before, with the same answers and the same errors.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any, Mapping

from neutrain.errors import RecipeError
from neutrain.files import read_json_object

DERIVED_HEAD_DIM = frozenset({"llama", "mistral", "qwen2"})
"""Architectures whose config class, given no ``head_dim``, uses ``hidden_size // num_attention_heads``
(``tests/unit/config/test_model_shape.py`` holds each to its transformers class)."""

SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
"""The counts every plain read needs given: their class defaults differ between architectures."""

BYTE_VOCAB = 259
"""The byte tokenizer's vocabulary (256 bytes and three special tokens), what ``model.tokenizer: byte`` sizes to."""


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _mapping(model: Mapping[str, Any]) -> dict | None:
    """The config mapping the model section names, or None where only transformers can read it."""
    cfg = model["config"]
    if isinstance(cfg, Mapping):
        return dict(cfg)
    if model.get("gguf_file"):
        return None
    path = cfg if cfg is not None else os.path.join(str(model.get("base_model") or ""), "config.json")
    if cfg is None and not (model.get("base_model") and os.path.isdir(model["base_model"])):
        return None  # a hub id: the cache lookup is transformers'
    try:
        return read_json_object(path, f"model.config: file '{path}'", RecipeError)
    except RecipeError:
        return None  # the config class's reader names what is wrong


def _tokenizer_size(model: Mapping[str, Any]) -> int | None:
    """The vocabulary a recipe's own tokenizer will have, as the planner counts it before one is built."""
    return BYTE_VOCAB if model.get("tokenizer") == "byte" else model.get("tokenizer_vocab_size")


def plain_shape_config(model: Mapping[str, Any]) -> SimpleNamespace | None:
    """The config attributes the memory planner reads, from the model section's mapping alone, or None.

    The vocabulary is the one the built config would have: a random init's is the trained or byte
    tokenizer's size unless an inline ``model.config`` names ``vocab_size``; a base model keeps its own.

    Example:
        >>> cfg = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
        ...        "num_attention_heads": 4, "num_key_value_heads": 1, "tie_word_embeddings": True}
        >>> shape = plain_shape_config({"config": cfg, "tokenizer": "train-bpe", "tokenizer_vocab_size": 8192})
        >>> shape.vocab_size, shape.head_dim, shape.num_key_value_heads
        (8192, 64, 1)
        >>> plain_shape_config({"config": {**cfg, "model_type": "gemma"}, "tokenizer": "byte"}) is None
        True
    """
    values = _mapping(model)
    if values is None or values.get("model_type") not in DERIVED_HEAD_DIM:
        return None
    if not all(_whole(values.get(key)) for key in SIZES) or not isinstance(values.get("tie_word_embeddings"), bool):
        return None
    heads, hidden = values["num_attention_heads"], values["hidden_size"]
    if hidden % heads or heads % values["num_key_value_heads"]:
        return None  # refused by the class or the build, in their own words
    head_dim = values.get("head_dim")
    if head_dim is None:
        head_dim = hidden // heads
    elif not _whole(head_dim):
        return None
    vocab = values.get("vocab_size")
    if model["config"] is not None:  # sized to the recipe's own tokenizer, as the built config is
        words = _tokenizer_size(model)
        inline_vocab = isinstance(model["config"], Mapping) and "vocab_size" in model["config"]
        vocab = words if model.get("tokenizer") in ("byte", "train-bpe") and not inline_vocab else vocab
        if not _whole(words) or not _whole(vocab) or vocab < words:
            return None  # the config class's path sizes or refuses it, in its own words
    if not _whole(vocab):
        return None
    return SimpleNamespace(hidden_size=hidden, num_attention_heads=heads,
                           intermediate_size=values["intermediate_size"],
                           num_hidden_layers=values["num_hidden_layers"],
                           num_key_value_heads=values["num_key_value_heads"], vocab_size=vocab,
                           tie_word_embeddings=values["tie_word_embeddings"], head_dim=head_dim)
