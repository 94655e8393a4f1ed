"""``neutrain distill``: distil a draft from a trained target, as a recipe's ``distill`` section asks.

The distillation itself is :func:`neutrain.distill.draft.distill_from_recipe`; this command reads the recipe
and holds the run directory's lock around it.
"""

from __future__ import annotations

from neutrain.cli.outputs import refuse_outputs_on_inputs
from neutrain.config import load_recipe
from neutrain.distill.draft import distill_from_recipe
from neutrain.storage.confine import check_run_outputs
from neutrain.storage.run_dir import close_all, open_run, refuse_inside_model
from neutrain.storage.run_lock import RunLock


def configure(p) -> None:
    """The ``distill`` command's description and arguments, on its subparser ``p``."""
    p.description = ("Distil a draft from distill.target (default <train.output_dir>/export), report alpha, "
                     "export it to <train.output_dir>/draft and decode speculatively with it.")
    p.add_argument("recipe", help="recipe YAML file or shipped recipe name")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. distill.max_steps=200")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the draft and logs of an earlier distillation in train.output_dir (else refused)")


def run(args) -> int:
    """Distil the draft a recipe's ``distill`` section describes, holding ``train.output_dir``'s run lock.

    Why the lock: the draft, its logs and the target's export live in the run directory; two distillations
    at once interleaved their logs, and one beside a training run there read an export being replaced.
    """
    recipe = load_recipe(args.recipe, args.overrides)
    refuse_inside_model(recipe.train.output_dir, "train.output_dir")  # its draft/ would change a checkpoint or export
    refuse_outputs_on_inputs(recipe, [("train.output_dir", recipe.train.output_dir)])  # nor go among what it reads
    check_run_outputs(recipe.train.output_dir, ("draft", "distill", ".cache"))  # nor lead onto the run's other files
    with RunLock(recipe.train.output_dir):
        try:
            open_run(recipe.train.output_dir, create=False)  # the draft and its logs are listed as the run's
            distill_from_recipe(recipe, overwrite=args.overwrite)
        finally:
            close_all()
    return 0
