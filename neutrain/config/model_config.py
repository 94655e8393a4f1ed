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

import builtins
import collections.abc
import difflib
import inspect
import math
import os
import re
import types
import typing
from collections.abc import Mapping
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from neutrain.config.model_values import ROTARY_KEYS, check_config_values, rotary_parts
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


def _declared_types(cls) -> dict[str, Any]:
    """The type the config class declares for each of its fields (transformers' config classes are dataclasses
    whose values it checks on construction); a string annotation is read as a type (:func:`_annotation`)."""
    import dataclasses

    if not dataclasses.is_dataclass(cls):
        return {}
    return {f.name: _annotation(f.type) for f in dataclasses.fields(cls)}


class _Unresolved(dict):
    """Names an annotation string is read with: the builtins and ``Literal``; any other (``torch``) stands for Any."""

    class _AnyModule:
        def __getattr__(self, name):
            return Any

    def __missing__(self, key):
        found = {"Literal": typing.Literal, "Any": Any, "None": None}.get(key, getattr(builtins, key, None))
        return found if isinstance(found, type) or key in ("Literal", "Any", "None") else self._AnyModule()


def _annotation(hint: Any) -> Any:
    """A field's type, a string annotation (``"list[str] | None"``, postponed by its module) read as a type; one
    that cannot be read is Any (the class's own check decides)."""
    if not isinstance(hint, str):
        return hint
    try:
        return eval(hint, {"__builtins__": {}}, _Unresolved())  # noqa: S307 (the config class's own annotation)
    except Exception:  # noqa: BLE001 (any annotation this reading does not follow)
        return Any


def _matches(value: Any, hint: Any) -> bool:
    """``value`` is of the declared type ``hint`` (as a YAML or JSON value can be: lists for tuples)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or isinstance(hint, (str, typing.ForwardRef)):
        return True
    if hint is None or hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in args)
    if origin is typing.Literal:
        return any(value == arg and type(value) is type(arg) for arg in args)
    if origin in (list, tuple, set, collections.abc.Sequence):
        items = args[:1] if origin is not tuple or len(args) == 2 and args[1] is Ellipsis else ()
        return isinstance(value, (list, tuple)) and all(_matches(v, items[0]) for v in value) if items else \
            isinstance(value, (list, tuple))
    if origin in (dict, collections.abc.Mapping) or hint is dict or typing.is_typeddict(hint):
        return isinstance(value, dict)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, float)
    try:
        return isinstance(value, hint)
    except TypeError:  # a generic the checks above do not know: the class's own check decides
        return True


def _described(hint: Any) -> str:
    """``hint`` in words (``list[str] | None``: "a list of strings or null")."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is None or hint is type(None):
        return "null"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(_described(arg) for arg in args))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(arg) for arg in args)
    if origin in (list, tuple, set, collections.abc.Sequence):
        return f"a list of {_described(args[0]).removeprefix('a ').removeprefix('an ')}s" if args and \
            args[-1] is not Ellipsis or len(args) == 2 else "a list"
    if origin in (dict, collections.abc.Mapping) or hint is dict or typing.is_typeddict(hint):
        return "a mapping"
    words = {bool: "true or false", int: "an integer", float: "a number",
             str: "a string"}
    return words.get(hint, getattr(hint, "__name__", str(hint)))


def _check_declared_type(where: str, key: str, value: Any, hint: Any) -> None:
    """``value`` has the type the config class declares for ``key``: else one line naming the key and that type.

    Why: the class refused it in its own words ("Qwen2Config refuses these values: Validation error for field
    'layer_types': TypeError: ... doesn't match any type in (list[str], <class 'NoneType'>)"), a traceback's
    text that named no recipe key.
    """
    at = f"{where}.{key}"
    if isinstance(value, float) and not math.isfinite(value):
        raise RecipeError(f"{at}: {value} is not a finite number")
    if not _matches(value, hint):
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        words, advice = _described(hint), ""
        if "a number" in words and isinstance(value, str):
            advice = " (YAML reads 1e-5 without a dot as a string: write 1.0e-5)"
        elif "a number" in words and "an integer" not in words and isinstance(value, int):
            advice = f" (the class takes a float only: write {value}.0)"
        raise RecipeError(f"{at}: expected {words}, got {type(value).__name__} {shown}{advice}")


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


def rotary_names() -> list[str]:
    """The rotary scalings transformers has a function for (``default`` and its ``ROPE_INIT_FUNCTIONS``)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # lazy: imports torch

    return ["default", *sorted(ROPE_INIT_FUNCTIONS)]


def check_rotary_names(values: dict, where: str, keys: list[str], error: type[Exception] = RecipeError) -> None:
    """Each ``rope_type`` of ``keys`` (``rope_scaling``, ``rope_parameters``) is one transformers has.

    Why: an unknown one was accepted with a log line of transformers' ("Missing validation function") and failed
    as a ``KeyError`` inside the model's constructor, or trained unscaled."""
    for key in keys:
        for suffix, part in rotary_parts(values.get(key)):
            kind = part.get("rope_type", part.get("type")) if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in (names := rotary_names()):
                match = difflib.get_close_matches(kind, names, n=1)
                hint = f" Did you mean '{match[0]}'?" if match else ""
                raise error(f"{where}.{key}{suffix}.rope_type: {kind!r} is not a rotary scaling transformers has "
                            f"(one of {', '.join(names)}).{hint}")


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
    declared = _declared_types(cls)
    for key in keys:
        if key in values:
            field = attribute_map.get(key, key)
            if field in declared:  # the type the class checks on construction
                _check_declared_type(where, key, values[key], declared[field])
            else:
                _check_type(where, key, values[key], defaults.get(field))
    check_config_values(values, where, RecipeError, [k for k in keys if k in values])
    check_rotary_names(values, where, [k for k in keys if k in ROTARY_KEYS])
    try:
        built = cls(**values)
        # Inside the guard: the class writes its values out again (config.json beside every checkpoint), and
        # some fail only there (a torch_dtype of [] raised IndexError from to_dict).
        stored = built.to_dict()
    except Exception as exc:  # noqa: BLE001 (config classes raise ValueError, TypeError or strict-dataclass errors by version)
        field = re.match(r"Validation error for field '([^']+)'", str(exc))
        if field is not None:  # one field's own check (a range): named as the recipe's key, in the check's words
            name = next((k for k in keys if attribute_map.get(k, k) == field.group(1)), field.group(1))
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            raise RecipeError(f"{where}.{name}: {values.get(name)!r} is refused by {cls.__name__}: "
                              f"{one_line(cause)}") from None
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


POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")
"""The names a config gives the number of positions its model has (Llama's, GPT-2's, older ones')."""


def positions_of(config: Any) -> tuple[str, int] | None:
    """``(key, positions)`` of ``config`` (a mapping or a config object), or None where it names none."""
    for key in POSITION_KEYS:
        value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return key, value
    return None


DISTILL_PROMPT_TOKENS = 32
"""Tokens of the held-out prompt the distillation's closing speculative decode starts from."""


def context_uses(recipe) -> list[tuple]:
    """``(key, tokens, what[, beside])`` for each recipe value that sets how many positions the run feeds the model at
    once; ``beside``: the tokens that use adds to the key's own value.

    The distillation's speculative decode (after the whole run) feeds the target its prompt, ``distill.max_new_tokens``
    and up to a round's ``distill.draft_len`` more: past the positions it ran on in silence, and its payoff was
    measured there.
    """
    uses = [("data.sequence_len", recipe.data.sequence_len, "tokens a training row")]
    if recipe.eval.long_context_tasks:
        uses.append(("eval.context_len", recipe.eval.context_len, "tokens a long-context prompt"))
    if recipe.distill.enabled:
        d = recipe.distill
        uses.append(("distill.max_new_tokens", DISTILL_PROMPT_TOKENS + d.max_new_tokens + d.draft_len,
                     f"tokens of the draft's speculative decode (a {DISTILL_PROMPT_TOKENS}-token prompt, "
                     f"distill.max_new_tokens {d.max_new_tokens} and distill.draft_len {d.draft_len})",
                     DISTILL_PROMPT_TOKENS + d.draft_len))
    return uses


def check_context(config: Any, where: str, uses: list[tuple]) -> None:
    """Refuse a run that feeds the model more positions than its config has, naming both keys and values.

    Why: a ``data.sequence_len`` past ``max_position_embeddings`` trained in silence, on positions the model's
    rotary tables were never meant for (and with learned positions, GPT-2's, indexed past the table).

    Example:
        >>> check_context({"max_position_embeddings": 64}, "model.config", [("data.sequence_len", 128, "tokens a row")])
        Traceback (most recent call last):
        neutrain.errors.RecipeError: data.sequence_len: 128 tokens a row exceed model.config.max_position_embeddings 64 (the positions the model has); set data.sequence_len to at most 64, or give the model more positions
    """
    found = positions_of(config)
    if found is None:
        return
    key, positions = found
    for use, tokens, what, *beside in uses:  # beside: tokens the use adds to its key's value (a prompt)
        if tokens > positions:
            raise RecipeError(f"{use}: {tokens:,} {what} exceed {where}.{key} {positions:,} (the positions the model "
                              f"has); set {use} to at most {positions - sum(beside):,}, or give the model more "
                              "positions")


DERIVED_HEAD_DIM = frozenset({"llama", "mistral", "qwen2"})
"""Architectures whose config class, given no ``head_dim``, uses ``hidden_size // num_attention_heads``
(``tests/unit/config/test_model_shape.py`` holds each to its transformers class)."""

SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
"""The counts every plain read needs given: their class defaults differ between architectures."""

BYTE_VOCAB = 259
"""The byte tokenizer's vocabulary (256 bytes and three special tokens), what ``model.tokenizer: byte`` sizes to."""


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def config_mapping(model: ModelSection) -> dict | None:
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
    values = config_mapping(model)
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
