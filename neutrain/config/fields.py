"""The value types recipe keys are declared with, and the base class of every recipe section.

Why pydantic: a section is a class an editor and a type checker read (``recipe.train.learning_rate`` is a
float, ``memory.weights`` one of six words), each key's type, range and help written once, on the field, and
the JSON Schema editors validate against comes from the same classes. Validation runs once, when a recipe
is loaded (:mod:`neutrain.config.validate` turns pydantic's first error into the one line the CLI prints).

The types are strict: a boolean is no integer, ``3.0`` is no count and ``"5"`` no count either. A number
(``float``) also takes an integer, and a numeric string, since YAML 1.1 reads ``1e-5`` (no dot) as text.

Example:
    >>> from neutrain.config.sections import MemorySection
    >>> MemorySection(weights="neuzip-lossless").declared()["lora_r"].min
    1
"""

from __future__ import annotations

import functools
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Self, Union

import annotated_types
from pydantic import BaseModel, BeforeValidator, ConfigDict, Strict, ValidationInfo, field_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from neutrain.config.numbers import parse_number
from neutrain.config.values import Key, held_to_key

REQUIRED = object()
"""The default of a key that has none: the recipe must give it."""

COUNT_CEILING = 2**31 - 1
"""The largest number a key with no maximum of its own takes: a count past int32 is a typo, not a setting, and
the libraries it reaches index with int32 or spend a unit of work per count (``data.num_proc`` of 1e20 forked
processes until the machine ran out)."""

ROWS_MAX = 1 << 16
"""The most rows (sequences held in memory at once) a batch takes."""


def _number_from_text(value: Any) -> Any:
    """YAML 1.1 reads ``1e-5`` (no dot) as a string: a numeric string is the number it spells."""
    if isinstance(value, str):  # ASCII digits only (neutrain.config.numbers): '٣' stays text, refused
        number = parse_number(value)
        return value if number is None else number
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an integer of 400 digits is no float: refused as out of range
            return float("inf") if value > 0 else float("-inf")
    return value


Count = Annotated[int, Strict()]
"""A whole number (not a boolean, not ``3.0``)."""
Number = Annotated[float, BeforeValidator(_number_from_text), Strict()]
"""A finite real number: an integer or a numeric string is taken as one."""
Switch = Annotated[bool, Strict()]
"""true or false."""
Text = Annotated[str, Strict()]
"""A string without NUL."""


@dataclass(frozen=True)
class IsPath:
    """Marks a key whose string is a path that must exist: ``file``, ``dir`` or ``any`` (checked by ``stat``)."""

    kind: str


@dataclass(frozen=True)
class OneOf:
    """Marks a key whose value is one of an open set of names (:class:`neutrain.config.names.Names`)."""

    names: Any


_BOUNDS = {annotated_types.Ge: "min", annotated_types.Le: "max", annotated_types.Gt: "gt", annotated_types.Lt: "lt"}


def _plain(annotation: Any) -> tuple[Any, tuple]:
    """The type under ``Annotated`` and its metadata."""
    if typing.get_origin(annotation) is Annotated:
        base, *meta = typing.get_args(annotation)
        inner, more = _plain(base)
        return inner, (*meta, *more)
    return annotation, ()


def union_members(annotation: Any) -> list[Any]:
    """The types a (possibly optional, possibly annotated) union allows, each without its metadata."""
    base, _ = _plain(annotation)
    if typing.get_origin(base) in (Union, types.UnionType):
        return [m for arg in typing.get_args(base) for m in union_members(arg)]
    return [base]


def key_of(field: Any) -> Key:
    """The :class:`Key` a pydantic field declares."""
    members = union_members(field.annotation)
    nullable = type(None) in members
    kinds, choices, items = [], None, None
    for member in members:
        if member is type(None):
            continue
        origin = typing.get_origin(member)
        if origin is typing.Literal:
            choices, member = typing.get_args(member), str
        elif origin is list or member is list:
            member, args = list, typing.get_args(member)
            items = _plain(args[0])[0] if args else None
        elif origin is dict:
            member = dict
        if member not in kinds:
            kinds.append(member)
    meta = [*field.metadata, *(m for member in typing.get_args(field.annotation) for m in _plain(member)[1])]
    meta += [m for held in meta if isinstance(held, FieldInfo) for m in held.metadata]  # Field() inside a member
    bounds = {name: getattr(m, name.replace("min", "ge").replace("max", "le"))
              for m in meta for cls, name in _BOUNDS.items() if isinstance(m, cls)}
    pattern = next((m.pattern for m in meta if getattr(m, "pattern", None)), None)
    path = next((m.kind for m in meta if isinstance(m, IsPath)), None)
    choices = next((m.names for m in meta if isinstance(m, OneOf)), choices)
    if field.default_factory is not None:
        default = field.default_factory()
    else:
        default = REQUIRED if field.default is PydanticUndefined else field.default
    if len(kinds) > 1:
        choices = None  # a word beside a number (device_budget_gib: auto, or GiB): the words are no closed set
    return Key(kinds[0] if len(kinds) == 1 else tuple(kinds), default, " ".join((field.description or "").split()),
               choices=choices, pattern=pattern, path=path, nullable=nullable, items=items, **bounds)


class Declared(BaseModel):
    """A frozen pydantic model whose fields are recipe keys: no unknown key, no NaN, a docstring for each."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, use_attribute_docstrings=True,
                              validate_default=False)

    @classmethod
    @functools.cache
    def declared(cls) -> dict[str, Key]:
        """Each key's :class:`Key`, in declaration order."""
        return {name: key_of(field) for name, field in cls.model_fields.items()}

    def to_dict(self) -> dict[str, Any]:
        """The keys as plain data (what ``recipe.yaml`` beside the checkpoints holds)."""
        return {name: getattr(self, name) for name in type(self).model_fields}

    def changed(self, **values: Any) -> Self:
        """This section with ``values`` in place of its own (keys checked by name; values are the caller's).

        Example:
            >>> from neutrain.config.sections import MemorySection
            >>> MemorySection().changed(weights="neuzip-lossless").weights
            'neuzip-lossless'
        """
        unknown = set(values) - set(type(self).model_fields)
        if unknown:
            raise AttributeError(f"{type(self).__name__} has no key {', '.join(sorted(unknown))}")
        return self.model_copy(update=values)


class Section(Declared):
    """A recipe section: each value is also held to what any value must be (:func:`~neutrain.config.values.
    held_to_key`): a registered name, no NaN or NUL at any depth, a path that exists, of its kind."""

    section: ClassVar[str] = ""

    @field_validator("*", mode="after")
    @classmethod
    def _held_to_its_key(cls, value: Any, info: ValidationInfo) -> Any:
        base_dir = (info.context or {}).get("base_dir")
        return held_to_key(f"{cls.section}.{info.field_name}", cls.declared()[info.field_name], value, base_dir)
