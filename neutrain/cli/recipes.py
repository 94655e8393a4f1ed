"""``neutrain recipes``: list the shipped recipes, one line each; ``--schema`` prints a recipe's JSON Schema."""

from __future__ import annotations

import json

from neutrain.config import recipe_dirs
from neutrain.config.recipe_yaml import MAX_RECIPE_BYTES
from neutrain.errors import RecipeError
from neutrain.files import read_text


def configure(p) -> None:
    """The ``recipes`` command's description and its one flag, on its subparser ``p``."""
    p.description = "List shipped recipes, one line each."
    p.add_argument("--schema", action="store_true",
                   help="print the JSON Schema of a recipe file instead (for an editor's YAML language server)")


def run(args) -> int:
    """Print one line per shipped recipe: its name, first comment line and path; or the recipe JSON Schema."""
    if getattr(args, "schema", False):
        from neutrain.config import recipe_json_schema  # lazy: the listing reads no recipe

        print(json.dumps(recipe_json_schema(), indent=2))
        return 0
    found = False
    for d in recipe_dirs():
        for path in sorted(d.glob("*.yaml")):
            found = True
            text = read_text(path, f"recipe file '{path}'", MAX_RECIPE_BYTES, RecipeError)  # ./recipes is the user's
            print(f"{path.stem:<22} {describe(text)}  ({path})")
    if not found:
        print("no recipes found (looked in: ./recipes and $NEUTRAIN_RECIPES)")
    return 0


def describe(text: str) -> str:
    """A recipe's description: the first sentence of its first comment paragraph, however many lines it spans.

    Why: taking the first comment line cut a description that wraps mid-sentence.

    Example:
        >>> describe("#!/usr/bin/env neutrain\\n# coding: neutrain-recipe\\n# A model trained for 60 steps, then\\n"
        ...          "# evaluated on long contexts. More here.\\n#\\n# Details.\\nmodel: {}\\n")
        'A model trained for 60 steps, then evaluated on long contexts.'
    """
    words: list[str] = []
    for line in text.splitlines():
        if line.startswith(("#!", "# coding:")):  # the shebang and the launch line
            continue
        if line.startswith("#") and line.strip("# "):
            words.extend(line.lstrip("#").split())
        elif words or not line.startswith("#"):  # the paragraph ended, or the YAML began
            break
    paragraph = " ".join(words)
    end = next((i + 1 for i, ch in enumerate(paragraph) if ch in ".!?" and paragraph[i + 1:i + 2] in ("", " ")), None)
    return paragraph[:end] if end else paragraph
