"""``neutrain estimate``: predict a recipe's peak GPU memory from its model config, loading no weights."""

from __future__ import annotations

from neutrain.config import load_recipe


def configure(sub) -> None:
    """Add the ``estimate`` command to the ``neutrain`` parser's subcommands."""
    p = sub.add_parser("estimate", help="predict peak GPU memory of a recipe before loading anything",
                       description="Predict peak GPU memory from the model config and the recipe (no weights are loaded).")
    p.add_argument("recipe", help="recipe YAML file or shipped recipe name")
    p.add_argument("overrides", nargs="*", help="dotted overrides")


def run(args) -> int:
    """Print the planner's predicted peak memory, term by term, for a recipe."""
    from neutrain.trainer.planner import estimate_recipe  # lazy: `neutrain --help` stays instant

    recipe = load_recipe(args.recipe, args.overrides)
    est = estimate_recipe(recipe)
    st = est.settings
    print(f"{recipe.source}: {st['params'] / 1e9:.2f}B parameters, batch {st['batch']} x {st['seq']} tokens, "
          f"weights {st['weights']}, optimizer {recipe.train['optimizer']}, checkpointing {st['checkpointing']}")
    print(est.table())
    return 0
