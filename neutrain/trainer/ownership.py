"""Which directory a run may write into, decided once at its start, from the identity file a run leaves there.

A run writes into an empty directory, or into its own run (:mod:`neutrain.storage.run_dir`):

* no identity file and nothing in it: a new run (the identity is written when the directory is created);
* no identity file, but files: refused, whatever the flags say (``train.overwrite_output_dir`` deletes
  only what a neutrain run lists as written, and such a directory lists nothing). A directory an earlier
  neutrain (before identity files) trained in is taken over by a resume; an overwrite of it is refused;
* an identity file: a resume continues it; a new launch with the recipe the run was started with is the
  same run (finished: "run already finished", as a resume would say; stopped: refused, naming it as this
  run's, not another's); a new launch with another recipe is refused while the directory holds the run's
  checkpoints, unless ``train.overwrite_output_dir`` deletes what the run listed (nothing else).

Example:
    >>> identity_recipe(load_recipe("default"))["train"]["seed"]  # doctest: +SKIP
    42
"""

from __future__ import annotations

import enum
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from neutrain.errors import RecipeError
from neutrain.storage.confine import check_run_outputs
from neutrain.storage.run_dir import (KEPT_ON_OVERWRITE, PLANNED, Ledger, clear_owned, entries, legacy_run, open_run, owned_checkpoints,
                                      read_ledger, unowned_planned, write_identity)
from neutrain.storage.run_lock import RunDirectoryError, previous_checkpoints, refuse_linked_checkpoints, unheld

logger = logging.getLogger("neutrain")

# Keys that say how to launch, not what the run is: a relaunch that changes them is the same run.
LAUNCH_KEYS = {"train": ("output_dir", "resume_from_checkpoint", "overwrite_output_dir")}


def identity_recipe(recipe) -> dict[str, Any]:
    """The recipe as the identity file records it: plain JSON data, without the keys of :data:`LAUNCH_KEYS`."""
    data = json.loads(json.dumps(recipe.to_dict(), default=str))
    for section, keys in LAUNCH_KEYS.items():
        for key in keys:
            data.get(section, {}).pop(key, None)
    return data


def first_difference(old: Any, new: Any, path: str = "") -> str | None:
    """``"key: old -> new"`` for the first recipe key that differs, else None.

    Example:
        >>> first_difference({"train": {"seed": 1}}, {"train": {"seed": 2}})
        'train.seed: 1 -> 2'
    """
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new), key=str):
            found = first_difference(old.get(key), new.get(key), f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
        return None
    if old == new:
        return None
    show = lambda v: (s if len(s := json.dumps(v, default=str)) <= 60 else s[:57] + "...")  # noqa: E731
    return f"{path}: {show(old)} -> {show(new)}"


def planned_names(recipe) -> tuple[str, ...]:
    """The names at the top of ``train.output_dir`` this run will write (besides its checkpoints)."""
    m, names = recipe.model, ["recipe.yaml", "metrics.jsonl", "summary.json", "training_curves.png", ".cache"]
    if (m.tokenizer or m.base_model) in ("byte", "train-bpe"):
        names.append("tokenizer")
    if recipe.eval.long_context_tasks:
        names.append("eval")
    if recipe.export.format != "none" and not recipe.export.output_dir:
        names.append("export")
    if recipe.distill.enabled:
        names += ["draft", "distill"]
    if recipe.memory.adapter and not m.base_model:
        names.append("base")
    return tuple(names)


def same_run(output_dir: str, recipe: dict[str, Any] | None) -> bool:
    """Whether ``output_dir`` holds the checkpoints of a run started with ``recipe`` (a relaunch of that run)."""
    try:
        ledger = read_ledger(output_dir)
    except RunDirectoryError:
        return False
    return (recipe is not None and ledger is not None and ledger.recipe == recipe
            and bool(owned_checkpoints(output_dir, ledger)))


class Verdict(enum.Enum):
    """What a directory's files say a launch may do there (:func:`decide`)."""

    NEW = "new"  # nothing there: a new run (its identity is written when the run opens it)
    TAKE_LEGACY = "take-legacy"  # an earlier neutrain's run (no identity file), resumed: taken over
    SAME_RUN = "same-run"  # a relaunch of the run there: its resume plan says finished, or names it as this run's
    OVERWRITE = "overwrite"  # a new run in place of the one there: what that run listed is deleted
    CONTINUE = "continue"  # the run there, resumed, or one that saved nothing relaunched
    UNMARKED = "unmarked"  # refused: files and no identity
    ANOTHER_RUN = "another-run"  # refused: another run's checkpoints
    UNREADABLE = "unreadable"  # refused: an identity file that is not one


@dataclass(frozen=True)
class Decision:
    """:func:`decide`'s answer: the verdict, the ledger it read, and the refusal (None where the launch may go on)."""

    verdict: Verdict
    ledger: Ledger | None = None
    mine: tuple[str, ...] = ()
    refusal: RunDirectoryError | None = field(default=None, compare=False)


def decide(output_dir: str, recipe: dict[str, Any] | None, resume: bool | str | None, overwrite: bool) -> Decision:
    """What a launch (``recipe``, ``resume``, ``overwrite``) may do in ``output_dir``, from its files alone; writes
    nothing. ``resume``: ``train.resume_from_checkpoint`` as given (a path: that checkpoint).

    Why one function: the refusals said before torch loads (:func:`refuse_used_directory`) and the decision made
    under the run's lock (:func:`take_directory`) were two copies of one tree, free to drift apart.

    Raises:
        CheckpointError: a ``checkpoint-N`` that is a symbolic link (named as the link it is, before it counts as
            anyone's).
    """
    refuse_linked_checkpoints(output_dir)
    try:
        ledger = read_ledger(output_dir)
    except RunDirectoryError as unreadable:
        return Decision(Verdict.UNREADABLE, refusal=unreadable)
    if ledger is None:
        found = entries(output_dir) if os.path.isdir(output_dir) else []
        if not found:
            return Decision(Verdict.NEW)
        if resume and legacy_run(output_dir):
            return Decision(Verdict.TAKE_LEGACY)
        return Decision(Verdict.UNMARKED, refusal=_unmarked(output_dir, found, overwrite))
    mine = tuple(owned_checkpoints(output_dir, ledger))
    if mine and recipe is not None and ledger.recipe != recipe and _elsewhere(resume, output_dir):
        # Another run's checkpoint continued into this run's folder: its rotation deleted this run's checkpoints,
        # and its metrics and recipe.yaml replaced this run's, under this run's name. An overwrite deletes them first.
        if overwrite:
            return Decision(Verdict.OVERWRITE, ledger, mine)
        return Decision(Verdict.ANOTHER_RUN, ledger, mine, _another_run(output_dir, ledger, list(mine), recipe, resume))
    if not resume and mine and not overwrite:
        if recipe is not None and ledger.recipe == recipe:
            return Decision(Verdict.SAME_RUN, ledger, mine)
        return Decision(Verdict.ANOTHER_RUN, ledger, mine, _another_run(output_dir, ledger, list(mine), recipe))
    if not resume and overwrite:
        return Decision(Verdict.OVERWRITE, ledger, mine)
    return Decision(Verdict.CONTINUE, ledger, mine)


def take_directory(output_dir: str, recipe: dict[str, Any] | None, resume: bool | str | None, overwrite: bool,
                   planned: tuple[str, ...] = PLANNED) -> None:
    """Decide, on the main process and under the run lock, whether this run may write into ``output_dir``.

    Refuses (:class:`RunDirectoryError`, one line) a directory the run may not use (:func:`decide`); clears a
    previous run's listed outputs on ``overwrite``. A relaunch of the same run is left to :func:`same_run` and
    the resume plan.
    """
    decision = decide(output_dir, recipe, resume, overwrite)
    if decision.refusal is not None:
        raise decision.refusal
    ledger = decision.ledger
    if decision.verdict is Verdict.TAKE_LEGACY:
        _take_legacy(output_dir, recipe)
    if decision.verdict in (Verdict.NEW, Verdict.TAKE_LEGACY, Verdict.SAME_RUN):
        return
    if decision.verdict is Verdict.OVERWRITE:
        clear_owned(output_dir, ledger)
        # A new run: what the old one listed is gone, but for the data cache it keeps (KEPT_ON_OVERWRITE).
        ledger = write_identity(output_dir, recipe, [n for n in KEPT_ON_OVERWRITE if n in ledger.wrote])
    _refuse_unowned(output_dir, ledger, planned)
    if not resume and not decision.mine:
        open_run(output_dir).set_recipe(recipe)  # a run that saved nothing, relaunched with this recipe


def _elsewhere(resume: bool | str | None, output_dir: str) -> bool:
    """Whether ``resume`` names a checkpoint outside ``output_dir`` (symlinks followed)."""
    if not isinstance(resume, str):
        return False
    real, top = os.path.realpath(resume), os.path.realpath(output_dir)
    return not real.startswith(top.rstrip(os.sep) + os.sep)


def _another_run(output_dir: str, ledger: Ledger, mine: list[str], recipe: dict[str, Any] | None,
                 resume: bool | str | None = None) -> RunDirectoryError:
    change = first_difference(ledger.recipe, recipe) if recipe is not None else None
    launch = (f"continuing {resume} there (a checkpoint of another folder)" if isinstance(resume, str)
              else "a new run")
    return RunDirectoryError(
        f"train.output_dir '{output_dir}' holds another run's checkpoints ({', '.join(mine[-3:])})"
        f"{f', started with another recipe ({change})' if change else ''}: {launch} would mix its metrics and "
        f"checkpoints with them. Resume it with train.resume_from_checkpoint=true, choose another train.output_dir, or "
        f"set train.overwrite_output_dir=true to delete what that run wrote")


def refuse_used_directory(output_dir: str, recipe: dict[str, Any], resume: bool | str | None, overwrite: bool) -> None:
    """:func:`take_directory`'s refusals that the files alone decide (:func:`decide`): a new run into another run's
    checkpoints, and a folder no neutrain run wrote.

    Why: the command line says them before torch and the Trainer are imported (seconds, where the refusal under
    the run's lock came after them); :func:`take_directory` still decides under the lock. A directory whose
    lock a run holds (or held, and died) is left to the lock, which names that run. Nothing is written.
    """
    if not os.path.isdir(output_dir) or not unheld(output_dir):
        return
    check_run_outputs(output_dir)  # the checks the run makes before take_directory's, in its order
    decision = decide(output_dir, recipe, resume, overwrite)
    # An unreadable identity file is named by take_directory, in its place among the run's checks.
    if decision.refusal is not None and decision.verdict is not Verdict.UNREADABLE:
        raise decision.refusal


def _take_legacy(output_dir: str, recipe: dict[str, Any] | None) -> None:
    """Written by a neutrain from before identity files: a resume takes it over, listing what a run writes there."""
    found = entries(output_dir)
    wrote = [n for n in found if n in PLANNED or n in previous_checkpoints(output_dir)]
    write_identity(output_dir, recipe, wrote)
    logger.warning("train.output_dir %s: a run of an earlier neutrain (no %s); resumed, its files %s taken as "
                   "this run's", output_dir, ".neutrain-run", ", ".join(wrote))


def _unmarked(output_dir: str, found: list[str], overwrite: bool) -> RunDirectoryError:
    shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    if legacy_run(output_dir):
        why = ("holds checkpoints of an earlier neutrain, which did not record what it wrote, so an overwrite "
               "cannot tell its files from yours" if overwrite else "holds another run's checkpoints")
        hint = ("resume it with train.resume_from_checkpoint=true, delete it yourself, or choose another "
                "train.output_dir")
    else:
        why = "is not empty and holds no neutrain run"
        hint = ("choose an empty or new train.output_dir (neutrain writes only into an empty directory or its own "
                "run, and train.overwrite_output_dir deletes only what a neutrain run wrote)")
    return RunDirectoryError(f"train.output_dir '{output_dir}' {why} ({shown}): nothing was written; {hint}")


def _refuse_unowned(output_dir: str, ledger: Ledger, planned: tuple[str, ...]) -> None:
    """Refuse, before training, a name the run will write (or a ``checkpoint-N`` it would take for its own: a
    resume picks the last one) that is there and was not written by it."""
    found = unowned_planned(output_dir, ledger, planned)
    if found:
        raise RunDirectoryError(
            f"train.output_dir '{output_dir}' holds {', '.join(found)}, which the run there did not write and this "
            f"run would write over: move {'them' if len(found) > 1 else 'it'} out of the run directory")


def note_resolved(key: str, given: str, itself: bool = True) -> str:
    """``given`` resolved once (symlinks followed) when a symlink is on its way, logged; else as it is.
    ``itself=False``: only the folders above it are resolved (an export's own path that is a link is refused).

    Why: the run writes through this path for hours; a symlink re-pointed meanwhile sent the later
    checkpoints, the export and the metrics into another folder, and rotation deleted that folder's files.
    """
    absolute = os.path.abspath(given)
    resolved = os.path.realpath(absolute)
    if not os.path.basename(resolved):
        # A folder the command creates, fills and may replace: never the file system's root (its staging and
        # lock names are siblings of the folder, and the root has none: a traceback before this check).
        raise RecipeError(f"{key}: '{given}' is the file system's root; name a folder to create under it")
    real = resolved if itself else os.path.join(os.path.realpath(os.path.dirname(absolute)), os.path.basename(absolute))
    if real == absolute:
        return given
    logger.info("%s '%s' is %s (a symlink on the way, resolved once: the run writes there to its end)", key, given, real)
    return real
