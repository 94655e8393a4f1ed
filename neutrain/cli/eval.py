"""``neutrain eval``: held-out perplexity of a checkpoint, plus the recipe's long-context tasks.

The target is a recipe (its ``output_dir``'s last checkpoint is evaluated) or a
checkpoint/export directory, with ``--recipe`` supplying data and eval settings.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from neutrain.config.model_config import check_context, context_uses
from neutrain.cli.checkpoints import check_vocabulary, last_checkpoint, load_model_checkpoint, recover_export
from neutrain.cli.ignored import refuse_ignored
from neutrain.cli.preflight import check_long_context_prompts
from neutrain.cli.train import long_context_eval
from neutrain.config import load_recipe
from neutrain.errors import UserInputError

# Suffixes of data files (a .json may be either data or a recipe, so it is left to the recipe loader).
_DATA_SUFFIXES = (".jsonl", ".csv", ".parquet", ".txt", ".text", ".md")


def _not_evaluable(target: Path) -> str | None:
    """Why ``target`` is neither a recipe nor a checkpoint, export or run directory; None when it may be one.

    Example:
        >>> _not_evaluable(Path("data/train.jsonl"))
        "eval: 'data/train.jsonl' is a data file; expected a recipe YAML or a checkpoint directory (data comes from the recipe's data.datasets)"
    """
    if target.suffix.lower() in _DATA_SUFFIXES and not target.is_dir():
        return f"eval: '{target}' is a data file; expected a recipe YAML or a checkpoint directory (data comes from the recipe's data.datasets)"
    if not target.is_dir() or (target / "config.json").exists() or (target / "adapter_config.json").exists():
        return None
    if any(p.is_dir() and p.name.startswith("checkpoint-") for p in target.iterdir()):
        return None
    names = sorted(p.name for p in target.iterdir())
    data = [n for n in names if Path(n).suffix.lower() in (*_DATA_SUFFIXES, ".json")]
    listed = lambda xs: ", ".join(xs[:3]) + (", ..." if len(xs) > 3 else "")  # noqa: E731
    found = (f"{len(data)} data file(s) ({listed(data)})" if data else f"{len(names)} other entries ({listed(names)})") if names else "nothing"
    return (f"eval: '{target}' is not a checkpoint: it holds {found} and no config.json, adapter_config.json or checkpoint-N; "
            f"expected a checkpoint, an export or a run's output_dir (give data through --recipe <recipe.yaml>)")


def _refuse_unowned_folder(run_dir: str):
    """The verdict on ``run_dir`` as the place evaluations write (``eval/``, ``.cache/``); a folder that is neither
    empty nor a run's is refused, one line, before anything loads.

    Why: ``neutrain eval`` into a folder of the user's wrote ``eval/`` and ``.cache/`` there, where a run writes
    only into an empty folder or its own. A run of an earlier neutrain (no identity file) is written into as before.
    """
    from neutrain.trainer.ownership import decide  # lazy: `neutrain --help` stays instant

    decision = decide(run_dir, None, resume=True, overwrite=False)  # what is there is continued, never replaced
    if decision.refusal is not None:
        raise decision.refusal
    return decision.verdict


def run_eval(args) -> int:
    """Run ``neutrain eval`` (see module docstring); prints a table and writes ``eval_results.json``."""
    from neutrain.storage.confine import check_output, check_run_outputs  # lazy: `neutrain --help` stays instant

    target = Path(args.target)
    if not target.exists():
        recover_export(target)  # set aside by an interrupted export: put back, and said so
    if args.recipe and not os.path.lexists(target):  # with --recipe the target is a checkpoint, never a recipe
        raise UserInputError(f"eval: checkpoint '{target}' does not exist")
    if problem := _not_evaluable(target):
        raise UserInputError(problem)
    # The model evaluated is the checkpoint's, never one built from the recipe's model section: its model.config
    # is held to neutrain's value rules only (shape_only), and its config class, which imports transformers and
    # torch, is not built, so a run with no checkpoint yet is one line at once.
    if target.suffix in (".yaml", ".yml") or not target.is_dir():
        refuse_ignored(args, ["recipe"], f"'{target}' is a recipe: its own data and eval settings are used",
                       "give a checkpoint as the target to evaluate it on --recipe's data")
        recipe = load_recipe(args.target, args.overrides, shape_only=True)
        ckpt = last_checkpoint(Path(recipe.train.output_dir))
    else:
        if not args.recipe:
            raise UserInputError(f"eval: '{target}' is a checkpoint; pass --recipe <recipe.yaml> for the held-out data")
        recipe = load_recipe(args.recipe, args.overrides, shape_only=True)
        ckpt = last_checkpoint(target)
    from neutrain.cli.outputs import eval_label, refuse_outputs_on_inputs  # lazy: `neutrain --help` stays instant
    from neutrain.storage.run_dir import claim, open_run, refuse_inside_model  # lazy: `neutrain --help` stays instant
    from neutrain.trainer.callbacks import MetricsFileCallback, PlotCallback  # lazy: `neutrain --help` stays instant
    from neutrain.trainer.ownership import Verdict, note_resolved  # lazy: `neutrain --help` stays instant
    from neutrain.trainer.progress import LabelledProgressCallback  # lazy: `neutrain --help` stays instant

    run_dir = note_resolved("train.output_dir", recipe.train.output_dir)  # where it leads now, to the end
    refuse_inside_model(run_dir, "train.output_dir")  # its eval/ and .cache/ would change a checkpoint or export
    refuse_outputs_on_inputs(recipe, [("train.output_dir", run_dir)])  # its eval/ never among the data it reads
    check_run_outputs(run_dir, ("eval", ".cache"))  # what it writes stays inside the run directory
    run_verdict = _refuse_unowned_folder(run_dir)
    # Only now, with the target and recipe known good, the heavy imports: a mistake above is one line at once.
    import torch  # lazy: after the checks
    from transformers import TrainingArguments

    from neutrain.data import Collator, build_datasets, pad_token_id  # lazy: after the checks
    from neutrain.trainer import NeuTrainer  # lazy: after the checks

    model, tokenizer = load_model_checkpoint(ckpt)  # a LoRA run's checkpoint: its adapters on its base
    if tokenizer is None:
        raise UserInputError(f"checkpoint '{ckpt}' has no tokenizer files")
    check_vocabulary(model, tokenizer, f"checkpoint '{ckpt}'")
    check_context(model.config, f"checkpoint '{ckpt}' config", context_uses(recipe))  # rows its positions hold
    # Each task's prompts in this tokenizer, before the held-out evaluation: one too long for eval.context_len was a
    # ValueError traceback after it.
    check_long_context_prompts(tokenizer, recipe.eval)
    # The run's own model writes eval/; another model's writes under its own name, never over the run's results.
    label = eval_label(ckpt, Path(run_dir))
    out = os.path.join(run_dir, "eval", label) if label else os.path.join(run_dir, "eval")
    if run_verdict is Verdict.NEW:  # an empty folder (or none) becomes a run's that holds only evaluations
        os.makedirs(run_dir, exist_ok=True)
    open_run(run_dir, create=run_verdict is Verdict.NEW)  # a run's directory lists what its evaluations write too
    claim(out)
    results = {"checkpoint": str(ckpt)}
    if recipe.eval.perplexity:
        claim(os.path.join(run_dir, ".cache"))
        _, heldout = build_datasets(recipe.data, tokenizer, os.path.join(run_dir, ".cache"))
        if heldout is None:
            raise UserInputError("data: no held-out data (set data.val_set_size or a dataset with split: validation)")
        if recipe.eval.max_eval_samples:
            heldout = heldout.select(range(min(len(heldout), recipe.eval.max_eval_samples)))
        targs = TrainingArguments(output_dir=out, per_device_eval_batch_size=recipe.eval_micro_batch_size,
                                  report_to="none", use_cpu=recipe.train.use_cpu, remove_unused_columns=False,
                                  dataloader_pin_memory=not recipe.train.use_cpu and torch.cuda.is_available())
        trainer = NeuTrainer(model=model, args=targs, eval_dataset=heldout, data_collator=Collator(pad_token_id(tokenizer)), processing_class=tokenizer)
        # Nothing trains: no training log or curves (they would append unnamed rows beside the run's), and the log
        # line names the checkpoint, not "before training".
        for callback in (MetricsFileCallback, PlotCallback):
            trainer.remove_callback(callback)
        for callback in trainer.callback_handler.callbacks:
            if isinstance(callback, LabelledProgressCallback):
                callback.stage = f"evaluation of {ckpt.name}"
        metrics = trainer.evaluate()
        results["heldout_loss"] = metrics["eval_loss"]
        from neutrain.eval.perplexity import perplexity_record, perplexity_text  # lazy: the eval package brings torch

        results["heldout_perplexity"] = perplexity_record(metrics["eval_loss"])  # null past its bound
        print(f"held-out {perplexity_text(metrics['eval_loss'])}  ({len(heldout)} rows, {ckpt})")
    if recipe.eval.long_context_tasks:
        results["long_context"] = long_context_eval(model, tokenizer, recipe.eval, out)
        for cache, m in results["long_context"].items():
            print(f"long context {cache}: accuracy {m.get('accuracy', float('nan')):.1f}%, KV compression {m.get('compression_ratio', float('nan')):.2f}x")
    Path(out).mkdir(parents=True, exist_ok=True)
    from neutrain.storage.durable import write_durably  # lazy: `neutrain --help` stays instant

    write_durably(check_output(Path(out) / "eval_results.json", run_dir), json.dumps(results, indent=2, default=str))
    if label:
        print(f"results of {ckpt} (not the run in {run_dir}) written to {out}")
    return 0


def configure(p) -> None:
    """The ``eval`` command's description and arguments, on its subparser ``p``."""
    p.description = "Held-out loss/perplexity for a checkpoint (with the recipe's data), plus long-context tasks."
    p.add_argument("target", help="recipe YAML (evaluates its output_dir's last checkpoint) or a checkpoint/export directory")
    p.add_argument("overrides", nargs="*", help="dotted overrides")
    p.add_argument("--recipe", help="recipe that supplies data and eval settings when TARGET is a checkpoint")


def run(args) -> int:
    """Run ``neutrain eval`` (see :func:`run_eval`)."""
    from neutrain.storage.run_dir import close_all  # lazy: `neutrain --help` stays instant

    try:
        return run_eval(args)
    finally:
        close_all()  # the run directory it listed its outputs in is not held past the command
