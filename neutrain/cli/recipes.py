"""``neutrain recipes``: list the shipped recipes, one line each."""

from __future__ import annotations

from neutrain.config import recipe_dirs


def configure(sub) -> None:
    """Add the ``recipes`` command to the ``neutrain`` parser's subcommands."""
    sub.add_parser("recipes", help="list the shipped recipes", description="List shipped recipes, one line each.")


def run(args) -> int:
    """Print one line per shipped recipe: its name, first comment line and path."""
    found = False
    for d in recipe_dirs():
        for path in sorted(d.glob("*.yaml")):
            found = True
            description = ""
            for line in path.read_text().splitlines()[1:6]:
                if line.startswith("#") and line.strip("# ") and not line.startswith("# coding:"):  # skip the launch line
                    description = line.lstrip("# ").strip()
                    break
            print(f"{path.stem:<22} {description}  ({path})")
    if not found:
        print("no recipes found (looked in: ./recipes and $NEUTRAIN_RECIPES)")
    return 0
