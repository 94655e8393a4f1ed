"""Recipes: typed sections, loading, dotted overrides and validation once at load."""

from neutrain.errors import CheckpointError, DataError, RecipeError, UserInputError
from neutrain.config.fields import Section
from neutrain.config.schema import (
    FUSED_OPTIMIZERS, KV_CACHES, OPTIMIZERS, SCHEMA, SECTION_TYPES, SECTIONS, DataSection, DistillSection, EvalSection,
    ExportSection, MemorySection, ModelSection, Recipe, TrainSection, recipe_json_schema,
)
from neutrain.config.validate import (
    apply_overrides, load_recipe, recipe_dirs, resolve_recipe_path, section_from, validate_recipe,
)

__all__ = [
    "CheckpointError", "DataError", "RecipeError", "UserInputError", "SCHEMA", "SECTIONS", "SECTION_TYPES", "Recipe",
    "Section", "ModelSection", "DataSection", "TrainSection", "MemorySection", "EvalSection", "ExportSection",
    "DistillSection", "FUSED_OPTIMIZERS", "OPTIMIZERS", "KV_CACHES",
    "apply_overrides", "load_recipe", "recipe_dirs", "recipe_json_schema", "resolve_recipe_path", "section_from",
    "validate_recipe",
]
