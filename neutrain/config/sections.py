"""Typed recipe sections, generated from the schema table.

Why generated: :data:`neutrain.config.schema.SCHEMA` is where each key's type,
default, range and help text live; validation and ``neutrain train --help`` read
it. The section classes are built from the same table, so a default is written
once and code reads ``recipe.train.learning_rate`` instead of re-declaring
``train.get("learning_rate", 2e-5)`` where it is used.

A section is a frozen dataclass (attribute access, field types from the table)
and also a read-only ``Mapping``, so ``section["key"]``, ``dict(section)`` and
``{**section}`` keep working for code written against the plain dict sections.

Example:
    >>> from neutrain.config.schema import MemorySection
    >>> m = MemorySection(weights="neuzip-lossless")
    >>> m.weights, m["clip_mode"], m.lora_r
    ('neuzip-lossless', 'per_tensor', 16)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, Iterator, Optional, Union


class Section(Mapping):
    """Base of the generated section classes: read-only mapping access over the dataclass fields."""

    section: ClassVar[str] = ""
    names: ClassVar[tuple[str, ...]] = ()

    def __getitem__(self, name: str) -> Any:
        if name in self.names:
            return getattr(self, name)
        raise KeyError(f"{self.section}: no key '{name}'")

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def to_dict(self) -> dict[str, Any]:
        """The section as a plain dict (what ``recipe.yaml`` beside the checkpoints holds)."""
        return {name: getattr(self, name) for name in self.names}


def _annotation(key: Any) -> Any:
    types = key.type if isinstance(key.type, tuple) else (key.type,)
    hint = Union[types] if len(types) > 1 else types[0]
    return Optional[hint] if key.nullable or key.default is None else hint


def _field(key: Any, required: object) -> dataclasses.Field:
    meta = {"help": key.help}
    if key.default is required:
        return dataclasses.field(metadata=meta)
    if isinstance(key.default, (list, dict)):  # each section gets its own copy of a mutable default
        return dataclasses.field(default_factory=lambda d=key.default: copy.copy(d), metadata=meta)
    return dataclasses.field(default=key.default, metadata=meta)


def section_type(section: str, keys: Mapping[str, Any], required: object, module: str) -> type[Section]:
    """A frozen dataclass ``<Section>Section`` with one field per key of ``keys`` (``neutrain.config.schema.Key``).

    Args:
        section: The section's name (``"train"`` -> class ``TrainSection``).
        keys: The schema's keys of that section, in order.
        required: The schema's marker for a key without default; such a field must be given.
        module: The module the class is bound in under its name (so it pickles).

    Example:
        >>> from neutrain.config.schema import REQUIRED, SCHEMA
        >>> Eval = section_type("eval", SCHEMA["eval"], REQUIRED, __name__)
        >>> Eval().kv_caches, Eval.__name__
        (['full'], 'EvalSection')
    """
    fields = [(name, _annotation(key), _field(key, required)) for name, key in keys.items()]
    cls = dataclasses.make_dataclass(
        f"{section.capitalize()}Section", fields, bases=(Section,), frozen=True, eq=False, kw_only=True,
        namespace={"section": section, "names": tuple(keys),
                   "__doc__": f"The recipe's ``{section}`` section (keys, types and defaults: neutrain.config.schema)."},
    )
    cls.__module__ = module
    return cls
