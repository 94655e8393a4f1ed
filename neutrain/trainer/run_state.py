"""Where a run stands before it trains: leftovers cleared, and what ``resume_from_checkpoint`` means here.

Why: ``transformers.Trainer`` resumed from the final checkpoint of a finished run trains
once more past ``max_steps``, restarts the schedule and lets checkpoint rotation delete
the real final checkpoint. :func:`prepare_run` decides before anything is built:

* **finished** (the checkpoint is at or past ``train.max_steps``, or at the end of its
  epochs, and ``summary.json``, written after every phase that follows training, says
  so): nothing is trained, evaluated, exported or written; the caller prints
  :attr:`RunPlan.message` and exits 0. The output directory stays byte-identical.
* **trained, not finished** (:attr:`RunPlan.after_training`: the same, but no summary
  of that step: a signal, a kill or a full disk stopped the held-out evaluation, the
  export, the distillation or the summary): nothing is trained; the caller loads the
  checkpoint's weights and runs every phase after training again. Before, such a
  relaunch said "run already finished" and the export never came.
* **continued** (``max_steps`` raised past the checkpoint's own end): training goes on
  from the checkpoint with its optimizer, RNG and data position. What "exactly" means
  depends on the learning-rate schedule, and the log says which case holds:

  - the schedule's values for the steps already trained do not depend on ``max_steps``
    (``constant``, ``constant_with_warmup``, ``inverse_sqrt``): the continued run is the
    uninterrupted run with the larger ``max_steps``, loss for loss and bit for bit;
  - they do (``linear``, ``cosine``, ...): every later step uses the learning rate of the
    new schedule at its global step, as the uninterrupted larger run does, but the steps
    already trained followed the old, shorter schedule, so the weights differ from that
    run's. The log gives both learning rates at the seam.

Example:
    >>> plan = prepare_run(recipe.train, PartialState())  # doctest: +SKIP
    >>> if plan.finished:  # doctest: +SKIP
    ...     print(plan.message)
    ... else:
    ...     trainer.train(resume_from_checkpoint=plan.checkpoint)
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neutrain.errors import CheckpointError
from neutrain.files import MAX_RECORD_BYTES, read_json_object
from neutrain.storage.confine import check_run_outputs, check_tree
from neutrain.storage.leftovers import clean_run_dir
from neutrain.storage.run_dir import PLANNED, read_ledger
from neutrain.storage.manifest import foreign_files
from neutrain.storage.run_lock import RunDirectoryError, RunLock, previous_checkpoints
from neutrain.trainer.ownership import same_run, take_directory
from neutrain.trainer.resume_check import check_finished_resume

if TYPE_CHECKING:  # annotations only: the classes are not needed at run time
    from neutrain.config.sections import TrainSection

logger = logging.getLogger("neutrain")


@dataclass(frozen=True)
class RunPlan:
    """What to do: train from ``checkpoint`` (None: from scratch), nothing when ``finished``, or only the phases
    after training when ``after_training``."""

    checkpoint: str | None = None
    finished: bool = False
    step: int = 0
    message: str = ""
    after_training: bool = False


def prepare_run(train: TrainSection, state, recipe: dict[str, Any] | None = None,
                planned: tuple[str, ...] = PLANNED) -> RunPlan:
    """Lock ``train.output_dir`` and clear leftover temporaries (main process), then plan the resume (every process).

    ``state`` is Accelerate's ``PartialState``: the other processes wait until the main one
    has cleaned (a restored checkpoint must be seen by all), then each reads the same files.
    An existing directory is locked here, before anything in it is touched
    (:mod:`neutrain.storage.run_lock`; a new one once the preflight has created it), and the run may
    write only into an empty directory or its own run (:mod:`neutrain.trainer.ownership`): a new run
    into another run's is refused unless ``train.overwrite_output_dir`` deletes what that run wrote.
    ``recipe`` (:func:`~neutrain.trainer.ownership.identity_recipe`) tells a relaunch of the same run
    from another run: a finished one is left as it is, as a resume would leave it. ``planned``: the names
    the run will write there (:func:`~neutrain.trainer.ownership.planned_names`).
    """
    out = train.output_dir
    with state.main_process_first():
        if state.is_main_process and os.path.isdir(out):
            RunLock(out).acquire()
            check_run_outputs(out)  # a symlink among its outputs must not lead the run's writes outside it
            clean_run_dir(out)
            take_directory(out, recipe, train.resume_from_checkpoint, train.overwrite_output_dir, planned)
    if not train.resume_from_checkpoint and not train.overwrite_output_dir and same_run(out, recipe):
        plan = plan_resume(train.changed(resume_from_checkpoint=True))
        if plan.finished or plan.after_training:
            return plan
        raise RunDirectoryError(
            f"train.output_dir '{out}' holds this run's checkpoints (the same recipe, stopped at step {plan.step}): "
            f"continue it with train.resume_from_checkpoint=true, or set train.overwrite_output_dir=true to start it "
            f"again")
    plan = plan_resume(train)
    if plan.finished and recipe is not None:  # nothing is built: the run's own record of its model is its recipe
        check_finished_resume(plan.checkpoint, _started_with(Path(plan.checkpoint).parent), recipe)
    return plan


def _started_with(run_dir: Path) -> dict[str, Any] | None:
    """The recipe the run in ``run_dir`` was started with (its identity file), or None (none, or unreadable)."""
    try:
        ledger = read_ledger(run_dir)
    except RunDirectoryError:
        return None
    return None if ledger is None else ledger.recipe


def plan_resume(train: TrainSection) -> RunPlan:
    """Resolve ``train.resume_from_checkpoint`` against ``train.max_steps`` / ``num_epochs``; reads files only."""
    resume = train.resume_from_checkpoint
    out = train.output_dir
    if not resume:
        return RunPlan()
    if resume is True:
        from transformers.trainer_utils import get_last_checkpoint

        resume = get_last_checkpoint(out) if os.path.isdir(out) else None
        if resume is None:
            logger.info("train.resume_from_checkpoint: no checkpoint-N in %s yet; starting from scratch", out)
            return RunPlan()
    if os.path.isdir(resume):
        check_tree(resume)  # its trainer_state.json is read next: a symlink must not lead outside the checkpoint
    saved = _trainer_state(Path(resume))
    from neutrain.distributed.resume import WEIGHT_FILES, is_engine_checkpoint  # lazily: brings torch

    if saved is None and os.path.isdir(resume) and not is_engine_checkpoint(Path(resume)) and \
            not any((Path(resume) / name).is_file() for name in WEIGHT_FILES):
        # said before the model is built and the data read: the Trainer found it only after both
        raise CheckpointError(f"train.resume_from_checkpoint: '{resume}' holds neither trainer_state.json nor model "
                              "weights: it is not a checkpoint (a checkpoint-N folder of a run's train.output_dir)")
    if saved is None:  # not a directory, or no trainer_state.json: the Trainer reports which file is missing
        return RunPlan(checkpoint=str(resume))
    step, old_total = int(saved.get("global_step", 0)), int(saved.get("max_steps", 0))
    max_steps = train.max_steps
    if max_steps > 0:
        finished, target = step >= max_steps, f"train.max_steps {max_steps}"
    else:  # epoch-based: the saved ``epoch`` is the fraction of the data seen so far
        epochs = float(train.num_epochs)
        finished = step >= old_total and float(saved.get("epoch", 0.0)) + 1e-6 >= epochs
        target = f"train.num_epochs {epochs:g}"
    if finished and not summarised(out, step):
        message = (f"neutrain: {resume} is the last step ({step}, {target}) but the phases after training did not "
                   f"complete (no summary.json of it): running evaluation, export and the summary again")
        return RunPlan(checkpoint=str(resume), step=step, message=message, after_training=True)
    if finished:
        message = (f"neutrain: run already finished: {resume} is at step {step} ({target}). "
                   f"Nothing was trained, evaluated, exported or written. To train further raise {target.split()[0]}; "
                   f"to export: neutrain export {resume} --format hf")
        return RunPlan(checkpoint=str(resume), finished=True, step=step, message=message)
    logger.info("resuming from %s at step %d (%s)", resume, step, target)
    if max_steps > 0 and old_total and max_steps != old_total:
        logger.warning("%s", schedule_note(train, step, old_total, max_steps))
    elif max_steps <= 0 and step >= old_total:
        logger.warning("continuing the finished run in %s to %s; the schedule is rebuilt for the new length "
                       "(its learning rates are in metrics.jsonl)", out, target)
    _refuse_resaving_foreign(out, step)
    return RunPlan(checkpoint=str(resume), step=step)


def _refuse_resaving_foreign(out: str, step: int) -> None:
    """Refuse a resume from ``step`` while a later ``checkpoint-N`` holds a file the run did not write: saving
    step N again replaces that folder whole, and the user's file would go with it."""
    for name in previous_checkpoints(out):
        if int(name.rsplit("-", 1)[1]) > step and (foreign := foreign_files(Path(out) / name)):
            raise RunDirectoryError(f"train.resume_from_checkpoint: '{foreign[0]}' was not written by the run, and "
                                    f"resuming from step {step} saves {name} again, replacing that folder: nothing "
                                    f"was written; move the file out of '{Path(out) / name}' first")


SUMMARY = "summary.json"
"""Written last by a run, after every phase that follows training: its ``steps`` mark the run done."""


def summarised(output_dir: str | os.PathLike, step: int) -> bool:
    """Whether ``output_dir/summary.json`` is the summary of a run that finished at ``step``."""
    path = Path(output_dir) / SUMMARY
    try:  # no summary, or a broken one: the run is not marked done (the reader refuses a FIFO unopened)
        summary = read_json_object(path, f"run summary '{path}'", CheckpointError)
    except CheckpointError:
        return False
    return summary.get("steps") == step


def schedule_note(train: TrainSection, step: int, old_total: int, new_total: int) -> str:
    """Say whether continuing at ``step`` with ``new_total`` steps is the uninterrupted ``new_total``-step run.

    Compares the learning rates of the two schedules for steps 1..``step`` (the ones already
    trained); identical values mean the continued run is bit-identical to the uninterrupted one.
    """
    kind = train.lr_scheduler
    head = f"train.max_steps changed from {old_total} (the checkpoint's run) to {new_total}: continuing from step {step}"
    try:
        old, new = (_learning_rates(train, total, step + 1) for total in (old_total, new_total))
    except Exception as exc:  # the Trainer builds the same scheduler and reports the problem itself
        return f"{head}; could not compare the {kind} schedules ({type(exc).__name__}: {exc})"
    if old[:step] == new[:step]:
        return (f"{head}. The {kind} schedule of the steps already trained does not depend on max_steps, so this "
                f"run continues exactly as an uninterrupted {new_total}-step run (same losses, same weights)")
    return (f"{head}. The {kind} schedule depends on max_steps: steps {step + 1}..{new_total} use the "
            f"{new_total}-step schedule (learning rate {new[step]:.3g} at step {step + 1}, where the {old_total}-step "
            f"schedule used {old[max(step - 1, 0)]:.3g} at step {step}), but steps 1..{step} were trained on the "
            f"{old_total}-step schedule, so the weights differ from an uninterrupted {new_total}-step run. For that "
            f"run, start a fresh one with train.max_steps={new_total}")


def resync_learning_rate(scheduler) -> None:
    """Set the optimizer's learning rate to what ``scheduler`` gives at its (just loaded) step.

    Why: a checkpoint's optimizer state carries the learning rate its own schedule had
    reached; with ``max_steps`` raised, the first step after resuming would train at that
    stale rate (0 at the end of a linear decay) instead of the new schedule's. For an
    unchanged schedule this sets the very value already there.
    """
    inner = getattr(scheduler, "scheduler", scheduler)  # Accelerate's AcceleratedScheduler wraps it
    lambdas = getattr(inner, "lr_lambdas", None)
    if lambdas is None:  # not a LambdaLR: nothing derived from max_steps to resync
        return
    rates = [base * fn(inner.last_epoch) for base, fn in zip(inner.base_lrs, lambdas)]  # as LambdaLR.get_lr
    for group, rate in zip(inner.optimizer.param_groups, rates):
        if hasattr(group["lr"], "fill_"):  # a tensor learning rate (capturable optimizers) keeps its type
            group["lr"].fill_(rate)
        else:
            group["lr"] = rate
    inner._last_lr = rates


def _learning_rates(train: TrainSection, total: int, count: int) -> list[float]:
    """The learning rates of steps 1..``count`` of the recipe's schedule over ``total`` steps (as the Trainer builds it)."""
    import torch
    from transformers import get_scheduler

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=train.learning_rate)
    scheduler = get_scheduler(train.lr_scheduler, optimizer, num_warmup_steps=train.warmup_steps,
                              num_training_steps=total)
    rates = []
    for _ in range(count):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return rates


def _trainer_state(checkpoint: Path) -> dict[str, Any] | None:
    path = checkpoint / "trainer_state.json"
    if not os.path.lexists(path):
        return None
    try:  # NaN allowed: a skipped step's loss is logged as NaN in its log history
        saved = read_json_object(path, f"checkpoint file '{path}'", CheckpointError, MAX_RECORD_BYTES, allow_nan=True)
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}; resume from an earlier checkpoint-N") from None
    if not isinstance(saved.get("global_step"), int):
        raise CheckpointError(f"checkpoint '{checkpoint}': trainer_state.json has no integer global_step")
    for key, kinds in (("max_steps", (int,)), ("epoch", (int, float))):  # read by plan_resume and the Trainer
        value = saved.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise CheckpointError(f"checkpoint '{checkpoint}': trainer_state.json has {key}: {json.dumps(value)}, "
                                  f"expected a number; resume from an earlier checkpoint-N")
    return saved
