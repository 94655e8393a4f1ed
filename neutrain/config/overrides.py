"""Dotted command-line overrides, ``section.key=value``, read one way for every command that takes them (``train``,
``eval``, ``estimate``, ``distill``).

A value is read as its key's declaration says (:func:`override_value`); a key inside a mapping-valued key is
reached by more dots (``model.config.hidden_size=64``, ``train.lr_scheduler_kwargs.num_cycles=2``); each key is
overridden once (the same value again is no second value).

Why one reader: the value of an override was read as YAML, which cut a path at `` #`` and folded a newline; a key
given twice kept its last value without a word; and a key inside ``model.config`` could only be changed by giving
the whole mapping again, whose other keys were then gone.
"""

from __future__ import annotations

from typing import Any, Iterable

import yaml

from neutrain.config.recipe_yaml import load_yaml
from neutrain.config.schema import SCHEMA, SECTIONS, Key
from neutrain.errors import RecipeError
from neutrain.config.values import shown, suggest

_EXAMPLE = "e.g. train.learning_rate=1e-5"


def check_top_level(raw: Any, where: str) -> dict:
    """``raw`` as a recipe's mapping of sections (an empty recipe is ``{}``)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise RecipeError(f"{where}: expected a mapping of sections ({', '.join(SECTIONS)}), got {type(raw).__name__} {shown(raw)}")
    return raw


def _parse_scalar(text: str, name: str) -> Any:
    """An override's text read as a recipe file's YAML is (:func:`load_yaml`: decimal numbers, no duplicate keys, no
    alias bomb); text that is not YAML, or a value of no recipe type, is the text itself."""
    try:
        return load_yaml(text, name)
    except yaml.YAMLError:
        return text


_QUOTES = ("'", '"')


def override_value(key: Key | None, text: str, name: str = "override") -> Any:
    """The value of ``section.key=<text>``: YAML for numbers, booleans, lists and mappings; the literal text for a string.

    Why: parsed as YAML, ``train.output_dir=w/runs/exp #2`` became ``w/runs/exp`` (the rest is a YAML
    comment), and with ``train.overwrite_output_dir=true`` another run's checkpoints were deleted; a
    newline folded to a space. Where the key takes a string, the text is the value as typed, unless YAML
    reads it as another type the key accepts (``true`` for ``resume_from_checkpoint``, a number for
    ``device_budget_gib``, ``null`` where the key may be null) or it is one quoted YAML string
    (``'"true"'``, for the text ``true`` itself).

    Example:
        >>> override_value(SCHEMA["train"]["output_dir"], "w/runs/exp #2")
        'w/runs/exp #2'
        >>> override_value(SCHEMA["train"]["resume_from_checkpoint"], "true")
        True
        >>> override_value(SCHEMA["eval"]["sample_prompt"], '"a: b"')
        'a: b'
    """
    parsed = _parse_scalar(text, name)
    types = () if key is None else key.type if isinstance(key.type, tuple) else (key.type,)
    if str not in types or parsed == text:
        return parsed
    if isinstance(parsed, str):
        quoted = text.strip()
        return parsed if len(quoted) >= 2 and quoted[0] in _QUOTES and quoted[-1] == quoted[0] else text
    if parsed is None:
        return None if key.nullable and text.strip() in ("", "null", "~", "Null", "NULL") else text
    accepted = tuple(t for t in types if t is not str)
    number = isinstance(parsed, (int, float)) and not isinstance(parsed, bool) and float in accepted
    return parsed if isinstance(parsed, accepted) or number else text


def _set_inside(sec: dict, section: str, path: list[str], value: Any, item: str) -> None:
    """Set ``value`` at ``path`` (a mapping-valued key, then keys inside it) in the section ``sec``, copying each
    mapping on the way (the recipe read from the file is left as it was)."""
    key, inner = path[0], path[1:]
    declared = SCHEMA[section].get(key)
    if declared is None:  # named as the unknown key it is, with the nearest, by the section's validation
        sec[key] = {}
    elif dict not in (declared.type if isinstance(declared.type, tuple) else (declared.type,)):
        raise RecipeError(f"override '{item}': {section}.{key} is not a mapping, so it has no key '{inner[0]}'; "
                          f"give {section}.{key}=<value>")
    node = sec
    for depth, name in enumerate(path[:-1]):
        current = node.get(name)
        if isinstance(current, str) and depth == 0:
            raise RecipeError(f"override '{item}': {section}.{key} is the file '{current}', not a mapping in the "
                              f"recipe; set '{'.'.join(path[1:])}' in that file, or give {section}.{key} as a mapping")
        if current is not None and not isinstance(current, dict):
            where = ".".join([section, *path[:depth + 1]])
            raise RecipeError(f"override '{item}': {where} is {type(current).__name__} {shown(current)}, not a "
                              f"mapping, so it has no key '{path[depth + 1]}'")
        node[name] = dict(current or {})
        node = node[name]
    node[path[-1]] = value


def _same_or_inside(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def apply_overrides(raw: dict, overrides: Iterable[str]) -> dict:
    """Apply dotted ``section.key=value`` overrides (values as :func:`override_value` reads them; inside a
    mapping-valued key, as YAML reads them).

    Example:
        >>> apply_overrides({"train": {}}, ["train.max_steps=10"])["train"]["max_steps"]
        10
        >>> apply_overrides({}, ["train.learning_rate=1e-5"])["train"]  # YAML reads 1e-5 as text; validation converts it
        {'learning_rate': '1e-5'}
        >>> apply_overrides({}, ["train.output_dir=runs/exp #2"])["train"]
        {'output_dir': 'runs/exp #2'}
        >>> apply_overrides({"model": {"config": {"hidden_size": 32, "num_hidden_layers": 2}}},
        ...                 ["model.config.hidden_size=64"])["model"]["config"]
        {'hidden_size': 64, 'num_hidden_layers': 2}
    """
    raw = dict(check_top_level(raw, "recipe"))
    given: list[tuple[str, str]] = []  # (dotted key, override) of each override so far
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override '{item}': expected section.key=value, {_EXAMPLE}")
        dotted, text = item.split("=", 1)
        parts = [part.strip() for part in dotted.strip().split(".")]
        if len(parts) < 2 or not all(parts):
            raise RecipeError(f"override '{item}': expected section.key=value, {_EXAMPLE}")
        dotted = ".".join(parts)
        # A key overridden twice (or a mapping and a key inside it): the last value won without a word, where a
        # recipe refuses a key given twice and the command line a flag given twice. The same value again loses
        # nothing (a script's overrides and a user's that agree).
        first = next(((key, earlier) for key, earlier in given if _same_or_inside(key, dotted)), None)
        if first is not None and (first[0], first[1].split("=", 1)[1]) == (dotted, text):
            continue
        if first is not None:
            raise RecipeError(f"override '{item}': {dotted} is overridden twice ('{first[1]}', then '{item}'); "
                              "give it once")
        given.append((dotted, item))
        section, key = parts[:2]
        if section not in SCHEMA:
            raise RecipeError(f"override '{item}': unknown section '{section}'.{suggest(section, SECTIONS)}")
        current = raw.get(section)
        if current is not None and not isinstance(current, dict):
            raise RecipeError(f"{section}: expected a mapping of keys, got {type(current).__name__} {shown(current)} "
                              f"(so override '{item}' has nowhere to go)")
        sec = dict(current or {})
        if len(parts) == 2:
            sec[key] = override_value(SCHEMA[section].get(key), text, f"override '{dotted}'")
        else:
            _set_inside(sec, section, parts[1:], _parse_scalar(text, f"override '{dotted}'"), item)
        raw[section] = sec
    return raw
