"""The recipe: seven typed sections, and the views of them that the help text, the overrides and editors read.

The sections' classes (:mod:`neutrain.config.sections`, :mod:`neutrain.config.after_training_sections`) declare
every key once: its type, default, range and help. :data:`SCHEMA` is the same declarations as one
:class:`~neutrain.config.fields.Key` per key (``neutrain train --help``, dotted overrides, the one-line errors),
and :func:`recipe_json_schema` is them as JSON Schema (``neutrain recipes --schema``), for an editor to check a
recipe as it is written.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from neutrain.config.after_training_sections import DistillSection, EvalSection, ExportSection
from neutrain.config.fields import REQUIRED, Key, Section
from neutrain.config.names import FUSED_OPTIMIZERS, KV_CACHES, LONG_CONTEXT_TASKS, OPTIMIZERS, Names
from neutrain.config.sections import DataSection, DatasetEntry, MemorySection, ModelSection, TrainSection

__all__ = ["FUSED_OPTIMIZERS", "KV_CACHES", "LONG_CONTEXT_TASKS", "OPTIMIZERS", "REQUIRED", "SCHEMA", "SECTIONS", "SECTION_TYPES", "Key",
           "Names", "Recipe", "DatasetEntry", "recipe_json_schema"]

SECTION_TYPES: dict[str, type[Section]] = {cls.section: cls for cls in (
    ModelSection, DataSection, TrainSection, MemorySection, EvalSection, ExportSection, DistillSection)}
SECTIONS = tuple(SECTION_TYPES)
SCHEMA: dict[str, dict[str, Key]] = {name: cls.declared() for name, cls in SECTION_TYPES.items()}
DATASET_KEYS: dict[str, Key] = DatasetEntry.declared()


class Recipe(BaseModel):
    """A validated recipe: one typed section per schema section, with every default filled in.

    Example:
        >>> from neutrain.config import load_recipe
        >>> r = load_recipe("recipes/default.yaml", overrides=["train.learning_rate=1e-3"])
        >>> r.train.learning_rate
        0.001
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection
    train: TrainSection = Field(default_factory=TrainSection)
    memory: MemorySection = Field(default_factory=MemorySection)
    eval: EvalSection = Field(default_factory=EvalSection)
    export: ExportSection = Field(default_factory=ExportSection)
    distill: DistillSection = Field(default_factory=DistillSection)
    source: str | None = None
    """The recipe file, for messages."""
    explicit: frozenset[str] = frozenset()
    """``section.key`` names the recipe file or the command line set (the automatic memory fit never changes them)."""

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The recipe as nested plain data (what gets saved beside checkpoints)."""
        return {s: getattr(self, s).to_dict() for s in SECTIONS}

    def with_sections(self, **sections: Section) -> Recipe:
        """This recipe with whole sections replaced (``recipe.with_sections(train=recipe.train.changed(...))``)."""
        unknown = set(sections) - set(SECTIONS)
        if unknown:
            raise AttributeError(f"a recipe has no section {', '.join(sorted(unknown))}")
        return self.model_copy(update=sections)

    def changed(self, **keys: dict[str, Any]) -> Recipe:
        """This recipe with keys of its sections changed: ``recipe.changed(memory={"weights": "dense"})``.

        Example:
            >>> from neutrain.config import load_recipe
            >>> load_recipe("default").changed(memory={"offload_activations": True}).memory.offload_activations
            True
        """
        return self.with_sections(**{s: getattr(self, s).changed(**values) for s, values in keys.items()})

    @property
    def default_export_dir(self) -> str:
        """``<train.output_dir>/export``: where export.output_dir and distill.target point when unset."""
        return os.path.join(self.train.output_dir, "export")

    @property
    def export_dir(self) -> str:
        """Where the run's export goes: ``export.output_dir``, else :attr:`default_export_dir`."""
        return self.export.output_dir or self.default_export_dir

    @property
    def eval_micro_batch_size(self) -> int:
        """``eval.micro_batch_size``, else ``train.micro_batch_size``."""
        return self.eval.micro_batch_size or self.train.micro_batch_size


def recipe_json_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of a recipe file: every section and key, with its type, range, default and
    description; an open set of names (``train.optimizer``) lists the names registered now.

    Example:
        >>> schema = recipe_json_schema()
        >>> schema["required"], schema["$defs"]["TrainSection"]["properties"]["learning_rate"]["exclusiveMinimum"]
        (['data'], 0.0)
    """
    schema = Recipe.model_json_schema(mode="validation")
    schema["title"] = "neutrain recipe"
    for name in ("source", "explicit"):  # the loader's, never the file's
        schema["properties"].pop(name)
    schema["additionalProperties"] = False
    for section, cls in SECTION_TYPES.items():
        properties = schema["$defs"][cls.__name__]["properties"]
        for name, key in SCHEMA[section].items():
            if isinstance(key.choices, Names):
                properties[name]["enum"] = list(key.choices)
    _json_bounds(schema)
    datasets = schema["$defs"]["DataSection"]["properties"]["datasets"]
    datasets["items"] = {"anyOf": [{"type": "string", "description": "the entry's path"}, datasets["items"]]}
    return schema


_JSON_BOUNDS = {"gt": "exclusiveMinimum", "ge": "minimum", "lt": "exclusiveMaximum", "le": "maximum"}


def _json_bounds(node: Any) -> None:
    """Bounds written on a union's member reach pydantic's schema under their Python names: JSON Schema's here."""
    if isinstance(node, dict):
        for python, json_name in _JSON_BOUNDS.items():
            if python in node and node.get("type") in ("number", "integer"):
                node[json_name] = node.pop(python)
        for value in node.values():
            _json_bounds(value)
    elif isinstance(node, list):
        for value in node:
            _json_bounds(value)
