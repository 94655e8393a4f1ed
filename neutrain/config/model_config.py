"""Checking ``model.config`` against its architecture's config class before anything is built.

Why here and not at build time: a bad value (``hidden_size: -1``, a string where
an integer belongs) used to surface as a multi-line validation traceback from
transformers once the tokenizer and data were ready; an unknown key
(``hiden_size``) was worse: the config class stores any keyword it does not
know, so it was copied into ``config.json`` and the intended key kept its
default. Each is now one :class:`RecipeError` at load time; an unknown key
suggests the closest key the class defines, unless the recipe opts in with
``model.allow_unknown_config_keys: true``.

transformers is imported lazily: only recipes with a ``model.config`` pay for it.
"""

from __future__ import annotations

import difflib
import inspect
import json
import math
import re
import stat
from pathlib import Path
from typing import Any

from neutrain.errors import RecipeError, one_line

# Integer keys that count or size something: zero or negative values build nothing meaningful.
_POSITIVE_INT = re.compile(r"num_\w*(layers|heads)|\w*_size|head_dim|max_position_embeddings|n_(layer|head|embd|positions)")


MAX_CONFIG_BYTES = 16 << 20
"""A model's config.json is a few KiB; more is not a config (and a device file would never end)."""


def _read_config_file(path: Path, where: str) -> str:
    """The text of a config.json, refused unless it is a regular file of at most :data:`MAX_CONFIG_BYTES`.

    Why: a FIFO given as ``model.config`` blocked the run forever, and ``/dev/zero`` was read until memory
    ran out; the file's kind and size are checked before a byte is read.
    """
    try:
        info = path.stat()
    except OSError as exc:
        raise RecipeError(f"{where}: cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(info.st_mode) \
            else "a device or special file"
        raise RecipeError(f"{where}: is {kind}, not a config.json file")
    if info.st_size > MAX_CONFIG_BYTES:
        raise RecipeError(f"{where}: {info.st_size:,} bytes, more than a config.json holds ({MAX_CONFIG_BYTES >> 20} MiB)")
    with open(path, "rb") as fh:
        return fh.read(MAX_CONFIG_BYTES + 1).decode("utf-8")


def _load(cfg: dict | str) -> tuple[dict, str]:
    if isinstance(cfg, dict):
        return dict(cfg), "model.config"
    where = f"model.config ('{cfg}')"
    try:
        data = json.loads(_read_config_file(Path(cfg), where))
    except UnicodeDecodeError:
        raise RecipeError(f"{where}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise RecipeError(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: expected a JSON object, got {type(data).__name__}")
    return data, where


def _known_keys(cls, defaults: dict) -> set[str]:
    keys = set(defaults) | set(getattr(cls, "attribute_map", {}) or {})
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            keys |= {n for n, p in inspect.signature(init).parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD or p.kind is p.KEYWORD_ONLY}
    return keys - {"self"}


def _check_value(where: str, key: str, value: Any, default: Any) -> None:
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
        if _POSITIVE_INT.fullmatch(key) and value < 1:
            raise RecipeError(f"{at}: {value} must be a positive integer")
    elif isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            hint = " (YAML reads 1e-5 without a dot as a string: write 1.0e-5)" if isinstance(value, str) else ""
            raise RecipeError(f"{at}: expected a number, got {type(value).__name__} {value!r}{hint}")
        if "dropout" in key and not 0 <= value <= 1:
            raise RecipeError(f"{at}: {value} is outside [0, 1]")
        if key.endswith("eps") and value <= 0:
            raise RecipeError(f"{at}: {value} must be greater than 0")


def check_model_config(cfg: dict | str, allow_unknown: bool = False) -> None:
    """Check a recipe's ``model.config`` (mapping or config.json path) against its config class.

    Args:
        cfg: The inline mapping (with ``model_type``) or the path of a config.json.
        allow_unknown: Accept keys the config class does not define (they go into config.json as given).

    Raises:
        RecipeError: naming the key and value: a missing or unknown ``model_type``, a value of the
            wrong type or out of range, a value the config class itself refuses, or an unknown key.

    Example:
        >>> check_model_config({"model_type": "llama", "hiden_size": 64})
        Traceback (most recent call last):
        neutrain.errors.RecipeError: model.config: unknown key 'hiden_size' for LlamaConfig. Did you mean 'hidden_size'? ...
    """
    values, where = _load(cfg)
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
            _check_value(where, key, values[key], defaults.get(attribute_map.get(key, key)))
    try:
        built = cls(**values)
    except Exception as exc:  # noqa: BLE001 (config classes raise ValueError, TypeError or strict-dataclass errors by version)
        raise RecipeError(f"{where}: {cls.__name__} refuses these values: {one_line(exc)}") from None
    known = _known_keys(cls, defaults)
    # A key the class consumed (a legacy name such as rope_theta) is not stored under its own name;
    # one it did not know is stored verbatim and would be copied into config.json.
    stored = built.to_dict()
    unknown = [k for k in keys if k not in known and k in stored]
    if unknown and not allow_unknown:
        key = unknown[0]
        match = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        hint = f" Did you mean '{match[0]}'?" if match else ""
        raise RecipeError(f"{where}: unknown key '{key}' for {cls.__name__}.{hint} "
                          "(set model.allow_unknown_config_keys: true to keep it in config.json anyway)")
