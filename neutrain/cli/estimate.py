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
    print(f"{recipe.source}: {parameter_count(st['params'])} parameters, batch {st['batch']} x {st['seq']} tokens, "
          f"weights {st['weights']}, optimizer {recipe.train['optimizer']}, checkpointing {st['checkpointing']}")
    print(est.table())
    return 0


def parameter_count(n: int) -> str:
    """A parameter count as people write it: ``4.19M``, ``135M``, ``8.03B`` (a tiny model read "0.00B").

    Example:
        >>> parameter_count(4_194_304), parameter_count(134_515_008), parameter_count(8_030_261_248), parameter_count(950)
        ('4.19M', '135M', '8.03B', '950')
    """
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            value = n / scale
            return f"{value:.3g}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return str(n)
