"""Recipes: schema, loading, dotted overrides and strict validation."""

from neutrain.errors import CheckpointError, DataError, RecipeError, UserInputError
from neutrain.config.schema import SCHEMA, SECTIONS, Recipe
from neutrain.config.validate import apply_overrides, load_recipe, recipe_dirs, resolve_recipe_path, validate_recipe

__all__ = [
    "CheckpointError", "DataError", "RecipeError", "UserInputError", "SCHEMA", "SECTIONS", "Recipe",
    "apply_overrides", "load_recipe", "recipe_dirs", "resolve_recipe_path", "validate_recipe",
]
