"""Checking ``model.config`` against its architecture's config class before anything is built.

Why here and not at build time: a bad value (``hidden_size: -1``, a string where
an integer belongs) used to surface as a multi-line validation traceback from
transformers once the tokenizer and data were ready; an unknown key
(``hiden_size``) was worse: the config class stores any keyword it does not
know, so it was copied into ``config.json`` and the intended key kept its
default. Each is now one :class:`RecipeError` at load time; an unknown key
suggests the closest key the class defines, unless the recipe opts in with
``model.allow_unknown_config_keys: true``.

transformers is imported lazily: only recipes with a ``model.config`` pay for it, and not ``neutrain
estimate`` where the mapping gives the model's shape: :func:`plain_shape_config` reads it without the class.
Why: the planner needs eight numbers of a config, and building the class to get them imported transformers'
config machinery, and torch behind it: five of the estimate's seven seconds on a 2-core CPU. Where the
mapping holds every number the planner reads, and the architecture derives the rest the one way
:data:`DERIVED_HEAD_DIM` names, they are read from it; anything else (another architecture, a key
missing, a value of another type, a hub id) gives None, and the class is built as before, with the same
answers and the same errors.
"""

from __future__ import annotations

import difflib
import inspect
import math
import os
from collections.abc import Mapping
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from neutrain.config.model_values import check_config_values
from neutrain.errors import RecipeError, one_line
from neutrain.files import read_json_object

def _load(cfg: dict | str) -> tuple[dict, str]:
    if isinstance(cfg, dict):
        return dict(cfg), "model.config"
    # A FIFO blocked the run and /dev/zero was read until memory ran out: the one reader checks the kind first.
    return read_json_object(cfg, f"model.config: file '{cfg}'", RecipeError), "model.config"

if TYPE_CHECKING:  # the sections' module reads none of this one
    from neutrain.config.sections import ModelSection


def _known_keys(cls, defaults: dict) -> set[str]:
    keys = set(defaults) | set(getattr(cls, "attribute_map", {}) or {})
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            keys |= {n for n, p in inspect.signature(init).parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD or p.kind is p.KEYWORD_ONLY}
    return keys - {"self"}


def _check_type(where: str, key: str, value: Any, default: Any) -> None:
    """``value`` has the type of the class's default for ``key`` (its range: :mod:`neutrain.config.model_values`)."""
    at = f"{where}.{key}"
    if isinstance(value, float) and not math.isfinite(value):
        raise RecipeError(f"{at}: {value} is not a finite number")
    if value is None or default is None:
        return
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise RecipeError(f"{at}: expected a boolean, got {type(value).__name__} {value!r}")
    elif isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecipeError(f"{at}: expected an integer, got {type(value).__name__} {value!r}")
    elif isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            hint = " (YAML reads 1e-5 without a dot as a string: write 1.0e-5)" if isinstance(value, str) else ""
            raise RecipeError(f"{at}: expected a number, got {type(value).__name__} {value!r}{hint}")


def check_model_config(cfg: dict | str, allow_unknown: bool = False, config_class: bool = True) -> None:
    """Check a recipe's ``model.config`` (mapping or config.json path) against its config class.

    Args:
        cfg: The inline mapping (with ``model_type``) or the path of a config.json.
        allow_unknown: Accept keys the config class does not define (they go into config.json as given).
        config_class: False: neutrain's value rules only (:mod:`neutrain.config.model_values`), for a caller
            that reads the shape and builds nothing; the class (transformers, and torch behind it) is not imported.

    Raises:
        RecipeError: naming the key and value: a missing or unknown ``model_type``, a value of the
            wrong type or out of range, a value the config class itself refuses, or an unknown key.

    Example:
        >>> check_model_config({"model_type": "llama", "hiden_size": 64})
        Traceback (most recent call last):
        neutrain.errors.RecipeError: model.config: unknown key 'hiden_size' for LlamaConfig. Did you mean 'hidden_size'? ...
    """
    values, where = _load(cfg)
    if not config_class:
        check_config_values(values, where, RecipeError, [k for k in values if k != "model_type"])
        return
    _check(values, where, list(values), allow_unknown)


def check_draft_config(target_cfg: dict | str, overrides: dict, allow_unknown: bool = False) -> None:
    """Check ``distill.draft_config`` as the draft's config will be: the target's ``model.config`` with these overrides.

    Why: the draft is built after training, so a bad or misspelt override used to be found (or,
    misspelt, silently ignored) only once the training time was spent.

    Example:
        >>> check_draft_config({"model_type": "llama", "num_attention_heads": 4}, {"num_hiden_layers": 1})
        Traceback (most recent call last):
        neutrain.errors.RecipeError: distill.draft_config: unknown key 'num_hiden_layers' for LlamaConfig. ...
    """
    values, _ = _load(target_cfg)
    _check({**values, **overrides}, "distill.draft_config", [k for k in overrides if k != "model_type"], allow_unknown)


def _check(values: dict, where: str, keys: list[str], allow_unknown: bool) -> None:
    values = dict(values)
    model_type = values.pop("model_type", None)
    if not model_type:
        raise RecipeError(f"{where}: needs a 'model_type' (e.g. llama)")
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        match = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=1)
        hint = f" Did you mean '{match[0]}'?" if match else ""
        raise RecipeError(f"{where}.model_type: unknown model type {model_type!r}.{hint}")
    cls = CONFIG_MAPPING[model_type]
    defaults = cls().to_dict()
    attribute_map = getattr(cls, "attribute_map", {}) or {}
    for key in keys:
        if key in values:
            _check_type(where, key, values[key], defaults.get(attribute_map.get(key, key)))
    check_config_values(values, where, RecipeError, [k for k in keys if k in values])
    try:
        built = cls(**values)
        # Inside the guard: the class writes its values out again (config.json beside every checkpoint), and
        # some fail only there (a torch_dtype of [] raised IndexError from to_dict).
        stored = built.to_dict()
    except Exception as exc:  # noqa: BLE001 (config classes raise ValueError, TypeError or strict-dataclass errors by version)
        raise RecipeError(f"{where}: {cls.__name__} refuses these values: {one_line(exc)}") from None
    known = _known_keys(cls, defaults)
    # A key the class consumed (a legacy name such as rope_theta) is not stored under its own name;
    # one it did not know is stored verbatim and would be copied into config.json.
    unknown = [k for k in keys if k not in known and k in stored]
    if unknown and not allow_unknown:
        key = unknown[0]
        match = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        hint = f" Did you mean '{match[0]}'?" if match else ""
        raise RecipeError(f"{where}: unknown key '{key}' for {cls.__name__}.{hint} "
                          "(set model.allow_unknown_config_keys: true to keep it in config.json anyway)")


DERIVED_HEAD_DIM = frozenset({"llama", "mistral", "qwen2"})
"""Architectures whose config class, given no ``head_dim``, uses ``hidden_size // num_attention_heads``
(``tests/unit/config/test_model_shape.py`` holds each to its transformers class)."""

SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
"""The counts every plain read needs given: their class defaults differ between architectures."""

BYTE_VOCAB = 259
"""The byte tokenizer's vocabulary (256 bytes and three special tokens), what ``model.tokenizer: byte`` sizes to."""


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _mapping(model: ModelSection) -> dict | None:
    """The config mapping the model section names, or None where only transformers can read it."""
    cfg = model.config
    if cfg is None:
        base = model.base_model
        if model.gguf_file or not (base and os.path.isdir(base)):
            return None  # a GGUF file or a hub id: read by transformers
        cfg = os.path.join(base, "config.json")
    try:
        return _load(cfg)[0]
    except RecipeError:
        return None  # the config class's reader names what is wrong


def _tokenizer_size(model: ModelSection) -> int | None:
    """The vocabulary a recipe's own tokenizer will have, as the planner counts it before one is built."""
    return BYTE_VOCAB if model.tokenizer == "byte" else model.tokenizer_vocab_size


def plain_shape_config(model: ModelSection) -> SimpleNamespace | None:
    """The config attributes the memory planner reads, from the model section's mapping alone, or None.

    The vocabulary is the one the built config would have: a random init's is the trained or byte
    tokenizer's size unless an inline ``model.config`` names ``vocab_size``; a base model keeps its own.

    Example:
        >>> cfg = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
        ...        "num_attention_heads": 4, "num_key_value_heads": 1, "tie_word_embeddings": True}
        >>> from neutrain.config.sections import ModelSection
        >>> shape = plain_shape_config(ModelSection(config=cfg, tokenizer="train-bpe", tokenizer_vocab_size=8192))
        >>> shape.vocab_size, shape.head_dim, shape.num_key_value_heads
        (8192, 64, 1)
        >>> plain_shape_config(ModelSection(config={**cfg, "model_type": "gemma"}, tokenizer="byte")) is None
        True
    """
    values = _mapping(model)
    if values is None or values.get("model_type") not in DERIVED_HEAD_DIM:
        return None
    if not all(_whole(values.get(key)) for key in SIZES) or not isinstance(values.get("tie_word_embeddings"), bool):
        return None
    if values.get("attention_bias") or values.get("mlp_bias"):
        return None  # biases beyond the closed form's: the build's own table counts them
    heads, hidden = values["num_attention_heads"], values["hidden_size"]
    if hidden % heads or heads % values["num_key_value_heads"]:
        return None  # refused by the class or the build, in their own words
    head_dim = values.get("head_dim")
    if head_dim is None:
        head_dim = hidden // heads
    elif not _whole(head_dim):
        return None
    vocab = values.get("vocab_size")
    if model.config is not None:  # sized to the recipe's own tokenizer, as the built config is
        words = _tokenizer_size(model)
        inline_vocab = isinstance(model.config, Mapping) and "vocab_size" in model.config
        vocab = words if model.tokenizer in ("byte", "train-bpe") and not inline_vocab else vocab
        if not _whole(words) or not _whole(vocab) or vocab < words:
            return None  # the config class's path sizes or refuses it, in its own words
    if not _whole(vocab):
        return None
    return SimpleNamespace(hidden_size=hidden, num_attention_heads=heads,
                           intermediate_size=values["intermediate_size"],
                           num_hidden_layers=values["num_hidden_layers"],
                           num_key_value_heads=values["num_key_value_heads"], vocab_size=vocab,
                           tie_word_embeddings=values["tie_word_embeddings"], head_dim=head_dim,
                           qkv_bias=values["model_type"] == "qwen2")  # Qwen2's q, k and v always carry a bias
