"""pydantic's validation errors as the one line the CLI prints: the key's dotted path, then what it must be.

Why translate: pydantic reports every error of a recipe, each as a location tuple and a sentence about Python
types ("Input should be greater than 0"); a user wants the first problem, named by the key they wrote
(``train.learning_rate``, ``data.datasets[0].max_files``) and the range or choices it takes, on one line
(:class:`~neutrain.errors.RecipeError`, exit 2 from the CLI).

Example:
    >>> from neutrain.config.sections import TrainSection
    >>> from pydantic import ValidationError
    >>> try:
    ...     TrainSection(learning_rate=-1)
    ... except ValidationError as exc:
    ...     print(recipe_error(exc, TrainSection, "train"))
    train.learning_rate: -1.0 must be greater than 0.0
"""

from __future__ import annotations

import math
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from neutrain.config.fields import Declared, Key, union_members
from neutrain.config.values import shown, suggest, type_name
from neutrain.errors import RecipeError

# Checked before a key's own value: an unknown or missing key is the first thing to fix in a section.
_STRUCTURE = ("extra_forbidden", "missing")  # in this order


def recipe_error(exc: ValidationError, model: type[BaseModel], prefix: str = "") -> RecipeError:
    """The first of ``exc``'s errors as a :class:`RecipeError` naming the key's path (``prefix`` first, as
    ``"train"`` for a lone section).

    First: in the order of the sections and of their keys, a mapping's unknown keys before its missing ones and
    those before its values; of the errors a union's members give for one value, the one deepest in it
    (``train.report_to[0]`` rather than ``train.report_to``)."""
    errors = exc.errors(include_url=False)
    return RecipeError(_line(min(errors, key=lambda e: _rank(e, model, prefix)), model, prefix))


def _rank(error: dict, model: type[BaseModel], prefix: str) -> tuple:
    cls, places = model, []
    for item in error["loc"][:1 if prefix else 2]:
        order = list(cls.model_fields) if cls is not None else []
        places.append(order.index(item) if item in order else len(order))
        cls = _nested_model(cls.model_fields[item].annotation) if cls is not None and item in cls.model_fields else None
    structure = _STRUCTURE.index(error["type"]) if error["type"] in _STRUCTURE else len(_STRUCTURE)
    section, keys = (places[:1], places[1:]) if not prefix else ([], places)  # a section's own keys: after structure
    return (*section, structure, *keys, -len(error["loc"]))


def _nested_model(annotation: Any) -> type[Declared] | None:
    for member in union_members(annotation):
        if isinstance(member, type) and issubclass(member, Declared):
            return member
        for arg in typing.get_args(member):
            inner = _nested_model(arg)
            if inner is not None:
                return inner
    return None


def _path(prefix: str, loc: tuple) -> str:
    where = prefix
    for item in loc:
        where = f"{where}[{item}]" if isinstance(item, int) else f"{where}.{item}" if where else str(item)
    return where


def _walk(loc: tuple, model: type[BaseModel], prefix: str) -> tuple[str, Key | None, bool]:
    """``(where, key, element)``: the dotted path the error is at (a union member's tag left out), the key's
    declaration, and whether the error is at an element of a list key."""
    cls, key, element, where = model, None, False, prefix
    for item in loc:
        if isinstance(item, int):
            where, element = f"{where}[{item}]", True
        elif cls is not None and item in cls.model_fields:
            where, element = f"{where}.{item}" if where else item, False
            key = _key_of_field(cls, item)
            cls = _nested_model(cls.model_fields[item].annotation)
        # else: a union member's tag ("list[str]"): the path goes on inside the member
    return where, key, element


def _key_of_field(cls: type[BaseModel], name: str) -> Key | None:
    return cls.declared()[name] if issubclass(cls, Declared) else None


def _number(value: Any, key: Key | None) -> Any:
    types = () if key is None else key.type if isinstance(key.type, tuple) else (key.type,)
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            return value
    return value


def _line(error: dict, model: type[BaseModel], prefix: str) -> str:
    kind, value, ctx = error["type"], error.get("input"), error.get("ctx") or {}
    if kind == "value_error" and isinstance(ctx.get("error"), RecipeError):
        return str(ctx["error"])
    loc = error["loc"]
    if kind in _STRUCTURE:
        parent, name = _path(prefix, loc[:-1]), str(loc[-1])
        if kind == "missing":
            return f"{parent}: missing required key '{name}'"
        return f"{parent}: unknown key '{name}'.{suggest(name, list(_owner(loc, model).model_fields))}"
    where, key, element = _walk(loc, model, prefix)
    if kind in ("model_type", "model_attributes_type", "dict_type") and (key is None or element):
        return f"{where}: expected a mapping, got {type(value).__name__}"
    value = _number(value, key)
    number = shown(value) if isinstance(value, int) and not isinstance(value, bool) else value  # 400 digits: cut
    if kind == "finite_number" or (isinstance(value, float) and not math.isfinite(value)):
        return f"{where}: {value} is not a finite number"
    if kind == "greater_than_equal":
        return f"{where}: {number} is below the minimum {ctx['ge']}"
    if kind == "less_than_equal":
        return f"{where}: {number} is above the maximum {ctx['le']:,}"
    if kind == "greater_than":
        return f"{where}: {number} must be greater than {ctx['gt']}"
    if kind == "less_than":
        return f"{where}: {number} must be less than {ctx['lt']}"
    if kind == "string_pattern_mismatch":
        return f"{where}: {value!r} does not have the expected form ({key.help if key else ctx.get('pattern')})"
    if kind == "literal_error" and isinstance(value, str) and key is not None and key.choices is not None:
        choices = [str(c) for c in key.choices]
        return f"{where}: {value!r} is not one of {', '.join(choices)}.{suggest(value, choices)}"
    if key is not None:
        expected = type_name(key.items if element and key.items is not None else key.type)
        got = "null" if value is None else f"{type(value).__name__} {shown(value)}"
        return f"{where}: expected {expected}, got {got}"
    return f"{where}: {error['msg']}"


def _owner(loc: tuple, model: type[BaseModel]) -> type[BaseModel]:
    """The model class of the mapping an unknown key was found in."""
    cls = model
    for item in loc[:-1]:
        if isinstance(item, str) and item in cls.model_fields:
            cls = _nested_model(cls.model_fields[item].annotation) or cls
    return cls
