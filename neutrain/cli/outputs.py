"""Where each command writes, checked before it writes: never inside another run's checkpoint or export, and with
the room its saves need; and the name an evaluation writes under.

Example:
    >>> eval_label(Path("/runs/a/checkpoint-4"), Path("/runs/a"))
    ''
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from neutrain.config.schema import Recipe
from neutrain.storage.run_dir import refuse_inside_model


def check_output_places(recipe: Recipe) -> None:
    """Refuse a ``train.output_dir`` or ``export.output_dir`` that is a FIFO or a device, or lies inside a checkpoint,
    an export or another run's folder (one line, the key).

    Example:
        >>> from neutrain.config import load_recipe
        >>> import tempfile
        >>> check_output_places(load_recipe("default", [f"train.output_dir={tempfile.mkdtemp()}/run"]))
    """
    refuse_inside_model(recipe.train.output_dir, "train.output_dir")
    if recipe.export.format != "none":
        refuse_inside_model(recipe.export_dir, "export.output_dir" if recipe.export.output_dir else
                            "train.output_dir's export", may_be_one=True, own=recipe.train.output_dir)


def check_run_disk(ctx, start: int) -> None:
    """The disk check of a built run (:func:`neutrain.trainer.disk_plan.check_disk_space`), from step ``start``."""
    import math

    from neutrain.storage.run_dir import held, owned_checkpoints  # lazy: `neutrain --help` stays instant
    from neutrain.trainer.disk_plan import check_disk_space  # lazy: `neutrain --help` stays instant

    recipe, trainer = ctx.recipe, ctx.trainer
    steps = recipe.train.max_steps
    if steps <= 0:  # by epochs: the steps the epochs come to, where the data can be counted
        try:
            per_step = trainer.args.train_batch_size * trainer.args.gradient_accumulation_steps * trainer.args.world_size
            steps = math.ceil(len(trainer.train_dataset) / per_step * recipe.train.num_epochs)
        except TypeError:  # streamed data has no length: at least the final save
            steps = start + 1
    found = held(os.path.join(recipe.train.output_dir, "x"))
    existing = len(owned_checkpoints(found[0].root, found[0].ledger)) if found else 0
    planned = getattr(trainer, "placement", None)
    check_disk_space(recipe, trainer.model, start, existing, steps,
                     planned.activation_file_bytes if planned is not None else 0)


def eval_label(checkpoint: Path, run_dir: Path) -> str:
    """The sub-folder of ``<run>/eval`` an evaluation of ``checkpoint`` writes in: none ('') for the run's own
    checkpoints and exports, else one named after the model evaluated.

    Why: ``neutrain eval <another model's checkpoint> --recipe R train.output_dir=RUN`` replaced RUN's own
    ``eval/eval_results.json``, and nothing said which model the numbers were of.

    Example:
        >>> eval_label(Path("/elsewhere/b/checkpoint-2"), Path("/runs/a"))[:15]
        'b-checkpoint-2-'
    """
    real, run = Path(os.path.realpath(checkpoint)), Path(os.path.realpath(run_dir))
    if run in real.parents:
        return ""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{real.parent.name}-{real.name}")[:80]
    return f"{name}-{hashlib.sha256(str(real).encode()).hexdigest()[:8]}"
