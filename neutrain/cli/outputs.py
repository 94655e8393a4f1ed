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
from neutrain.errors import RecipeError
from neutrain.storage.confine import RUN_FILES
from neutrain.storage.run_lock import CHECKPOINT_NAME
from neutrain.storage.run_dir import is_housekeeping, refuse_inside_model

# Keys whose local file or folder a command reads, besides the data sets (data.datasets[i].path).
INPUT_KEYS = ("model.base_model", "model.tokenizer", "model.config", "model.gguf_file", "train.resume_from_checkpoint",
              "train.deepspeed", "train.fsdp_config", "distill.target")


def _own_product(key: str, top: str) -> bool:
    """Whether ``key`` reads the run's own ``top`` by design: a checkpoint to resume, a checkpoint or the export to
    distil (never the draft, which the distillation writes)."""
    model = bool(CHECKPOINT_NAME.fullmatch(top))
    return model if key == "train.resume_from_checkpoint" else key == "distill.target" and (model or top == "export")


def check_output_places(recipe: Recipe) -> None:
    """Refuse a ``train.output_dir`` or ``export.output_dir`` that is a FIFO or a device, or lies inside a checkpoint,
    an export or another run's folder (one line, the key).

    Example:
        >>> from neutrain.config import load_recipe
        >>> import tempfile
        >>> check_output_places(load_recipe("default", [f"train.output_dir={tempfile.mkdtemp()}/run"]))
    """
    refuse_inside_model(recipe.train.output_dir, "train.output_dir")
    export_key = "export.output_dir" if recipe.export.output_dir else "train.output_dir's export"
    if recipe.export.format != "none":
        refuse_inside_model(recipe.export_dir, export_key, may_be_one=True, own=recipe.train.output_dir)
        refuse_export_on_run_files(recipe.export_dir, export_key, recipe.train.output_dir)
    refuse_outputs_on_inputs(recipe, [("train.output_dir", recipe.train.output_dir)]
                             + ([(export_key, recipe.export_dir)] if recipe.export.format != "none" else []))


def refuse_export_on_run_files(export_dir: str, key: str, output_dir: str) -> None:
    """Refuse an export folder inside the run's folder at a name the run writes itself (its ``tokenizer``, a
    ``checkpoint-N``, ``eval``, its lock or temporaries), other than its ``export``.

    Why: ``export.output_dir=RUN/tokenizer`` trained the whole run, then found the run's own tokenizer there and
    refused the export, exit 2 with no summary; ``RUN/checkpoint-4`` would be the run's last checkpoint.

    Example:
        >>> refuse_export_on_run_files("/runs/a/tokenizer", "export.output_dir", "/runs/a")
        Traceback (most recent call last):
        neutrain.errors.RecipeError: export.output_dir '/runs/a/tokenizer' is where the run in '/runs/a' writes its own 'tokenizer': choose another folder (its default, '/runs/a/export', or one outside the run)
    """
    run, real = Path(os.path.realpath(output_dir)), Path(os.path.realpath(export_dir))
    if run not in real.parents:
        return
    top = real.relative_to(run).parts[0]
    if top != "export" and (top in RUN_FILES or CHECKPOINT_NAME.fullmatch(top) or is_housekeeping(top)):
        raise RecipeError(f"{key} '{export_dir}' is where the run in '{output_dir}' writes its own '{top}': choose "
                          f"another folder (its default, '{os.path.join(output_dir, 'export')}', or one outside the run)")


def recipe_inputs(recipe: Recipe) -> list[tuple[str, str]]:
    """``(key, path)`` of every local file or folder ``recipe`` names to be read (a hub id or a built-in name, which
    names nothing on this machine, is left out).

    Example:
        >>> from neutrain.config import load_recipe
        >>> recipe_inputs(load_recipe("default"))  # doctest: +SKIP
        [('data.datasets[0].path', '/home/me/data/train.jsonl')]
    """
    found = []
    for key in INPUT_KEYS:
        section, name = key.split(".")
        found.append((key, getattr(getattr(recipe, section), name)))
    found += [(f"data.datasets[{i}].path", entry["path"]) for i, entry in enumerate(recipe.data.datasets)]
    return [(key, value) for key, value in found if isinstance(value, str) and os.path.lexists(value)]


def refuse_outputs_on_inputs(recipe: Recipe, outputs: list[tuple[str, str]]) -> None:
    """Refuse an output folder that is, or lies inside, a file or folder the recipe reads, and an input that lies
    where the run writes or deletes (a name it writes in its ``train.output_dir``, anywhere in its export folder).

    Why: a run into ``DATA/run`` wrote its ``tokenizer.json`` and ``metrics.jsonl`` where the data folder is read
    whole, and failed reading its own tokenizer as a data row ("row 0 is not valid JSON"), or trained on its own
    logs; a ``model.base_model`` inside the run's ``checkpoint-N`` or ``export`` was rotated away or replaced by the
    run's own export; an export into the base model's folder replaced the model it was trained from.
    """
    for out_key, out in outputs:
        for key, given in recipe_inputs(recipe):
            if key == "distill.target" and out_key != "train.output_dir":
                continue  # read by `neutrain distill` after the run: the run's export is what it is meant to read
            refuse_overlap(out_key, out, key, given, run=out_key == "train.output_dir")


def refuse_overlap(out_key: str, out: str | os.PathLike, key: str, given: str | os.PathLike, run: bool = False) -> None:
    """Refuse the output folder ``out`` (named ``out_key``) where it is, or lies inside, ``given`` (an input named
    ``key``), or where ``given`` lies inside it; ``run``: ``out`` is a run's folder, and only the names the run
    writes there (and not a checkpoint to resume or the export to distil) are its.

    Example:
        >>> refuse_overlap("--output", "/models/a/merged", "--base", "/models/a")
        Traceback (most recent call last):
        neutrain.errors.RecipeError: --output '/models/a/merged' lies inside --base '/models/a', which the command reads: its own files would be written among what it reads; choose an output folder outside it
    """
    real_out, real = Path(os.path.realpath(out)), Path(os.path.realpath(given))
    if real_out == real or real in real_out.parents:
        raise RecipeError(f"{out_key} '{out}' {'is' if real_out == real else 'lies inside'} {key} '{given}', which "
                          "the command reads: its own files would be written among what it reads; choose an output "
                          "folder outside it")
    if real_out not in real.parents:
        return
    top = real.relative_to(real_out).parts[0]
    if not run or (not _own_product(key, top) and (top in RUN_FILES or CHECKPOINT_NAME.fullmatch(top))):
        raise RecipeError(f"{key} '{given}' lies inside {out_key} '{out}', where the command writes ('{top}' is "
                          "its own): it would replace or delete what it reads; move it out, or choose another output "
                          "folder")


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
