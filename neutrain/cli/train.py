"""The default run: recipe -> model, data -> NeuTrainer -> evaluation -> export -> summary.

``neutrain train`` and ``accelerate launch -m neutrain`` call :func:`train_from_recipe`.
A run goes left to right and nothing reaches back (see
docs/architecture.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import textwrap
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from neutrain import compat
from neutrain.compat.deepspeed_env import name_cpu_accelerator
from neutrain.compat.quiet import progress_bars_wanted
from neutrain.compat.trainer_hooks import make_training_arguments
from neutrain.config import load_recipe
from neutrain.config.schema import SCHEMA, Recipe
from neutrain.config.model_config import check_context, context_uses
from neutrain.config.validate import check_config_classes
from neutrain.cli.advice import warn_about_settings
from neutrain.cli.after_training import RunContext, after_training
from neutrain.cli.checkpoints import check_vocabulary
# Where `neutrain eval`, scripts and tests have always found them:
from neutrain.cli.after_training import format_summary, generate_sample, long_context_eval, loss_ends  # noqa: F401
from neutrain.cli.memory import fit_memory, settle_weights
from neutrain.cli.outputs import check_output_places, check_run_disk
from neutrain.cli.preflight import (
    accumulation_note, check_export_place, check_launch, check_long_context_prompts, check_machine_holds,
    check_sample_prompt, check_weight_offload_device,
    cpu_processes, preflight,
)
from neutrain.distributed import end_processes, exit_rank
from neutrain.distributed.arguments import distributed_arguments
from neutrain.errors import StoppedBySignal, UserInputError

logger = logging.getLogger("neutrain")


def training_arguments(recipe: Recipe, has_eval: bool):
    """Map the recipe's ``train`` (and ``memory``) sections onto ``TrainingArguments``."""
    from transformers import TrainingArguments

    t, m = recipe.train, recipe.memory
    optim = {"adamw": "adamw_torch", "sgd": "sgd"}.get(t.optimizer, "adamw_torch")
    kwargs: dict[str, Any] = dict(
        output_dir=t.output_dir,
        per_device_train_batch_size=t.micro_batch_size,
        per_device_eval_batch_size=recipe.eval_micro_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        learning_rate=t.learning_rate,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        lr_scheduler_type=t.lr_scheduler,
        lr_scheduler_kwargs=t.lr_scheduler_kwargs or {},
        warmup_steps=t.warmup_steps,
        num_train_epochs=t.num_epochs,
        max_steps=t.max_steps,
        max_grad_norm=t.max_grad_norm,
        logging_steps=t.logging_steps,
        save_strategy="steps",
        save_steps=t.save_steps,
        save_total_limit=t.save_total_limit,
        eval_strategy="steps" if (has_eval and t.eval_steps) else "no",
        eval_steps=t.eval_steps,
        seed=t.seed,
        data_seed=t.seed,
        report_to=t.report_to,
        dataloader_num_workers=t.dataloader_num_workers,
        # Pinned host memory only helps copies to a GPU; without one torch warns on every loader.
        dataloader_pin_memory=not t.use_cpu and _cuda_available(),
        use_cpu=t.use_cpu,
        optim=optim,
        remove_unused_columns=False,
        disable_tqdm=not progress_bars_wanted(),  # no bars in a log file or pipe (neutrain.compat.quiet)
        **distributed_arguments(t),
        save_safetensors=True,
        **compat.checkpointing_training_args(m.gradient_checkpointing),
    )
    return make_training_arguments(kwargs, TrainingArguments)


def _cuda_available() -> bool:
    import torch  # lazy: `neutrain --help` stays instant

    return torch.cuda.is_available()


def _phase(state, echo: Callable[[str], None], name: str) -> None:
    """Announce a phase of the run (main process only), so a user sees where the time goes."""
    if state.is_main_process:
        echo(f"\n== {name} ==")


def _save_recipe(recipe: Recipe, output_dir: str) -> None:
    path = Path(output_dir) / "recipe.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    from neutrain.storage.durable import write_durably  # lazy: `neutrain --help` stays instant
    from neutrain.storage.run_dir import claim  # lazy: `neutrain --help` stays instant

    claim(path)

    # recipe.tmp<pid>: the name neutrain.storage.leftovers clears after a kill
    write_durably(path, yaml.safe_dump(recipe.to_dict(), sort_keys=False), tmp=path.with_suffix(f".tmp{os.getpid()}"))


ADAPTER_BASE = "base"
"""Where a LoRA run with no base directory (random init, a GGUF file) writes its frozen base, beside the checkpoints."""


def _save_adapter_base(model, tokenizer, out: str) -> None:
    """Write the frozen base of a LoRA run that has no base directory to ``<output_dir>/base`` (once).

    Why: checkpoints hold only the adapters, and ``neutrain export <adapter checkpoint>`` needs the
    base they adapt; a random init or a GGUF file has no directory to name, so the export failed with "base
    model directory is unknown or missing (None)". The base is written as the adapters see it (lossy bases
    already rounded), in the dtype its weights are held in, so merging reproduces the trained model.
    """
    from neutrain.export import export_model  # lazy: `neutrain --help` stays instant

    path = Path(out) / ADAPTER_BASE
    if not (path / "config.json").exists():
        from neutrain.storage.run_dir import claim  # lazy: `neutrain --help` stays instant

        claim(path)
        export_model(model, str(path), "hf", tokenizer=tokenizer, info={"name": "neutrain LoRA base (frozen)"}, overwrite=True)


def _adapter_base(recipe: Recipe, out: str) -> str | None:
    """The content fingerprint of a LoRA run's frozen base (its checkpoints record it; an export merges onto no
    other base): ``<output_dir>/base`` when the run wrote it, else ``model.base_model`` when it is a local directory."""
    from neutrain.storage.fingerprint import model_fingerprint  # lazy: `neutrain --help` stays instant

    base = Path(out) / ADAPTER_BASE if not recipe.model.base_model else Path(recipe.model.base_model)
    return model_fingerprint(base) if base.is_dir() else None


def build_trainer(recipe: Recipe, resume: str | None = None, identity: dict | None = None,
                  placement=None) -> RunContext:
    """Build tokenizer, data, model and :class:`~neutrain.trainer.trainer.NeuTrainer` from a recipe, without training.

    ``resume``: the checkpoint the run will resume, refused (one line) when it was trained with another
    weights format, model shape, optimizer, tokenizer or dataset (:mod:`neutrain.trainer.resume_check`)
    before the recipe copy in ``output_dir`` is replaced. ``identity``: the recipe the run's identity file
    records (:func:`neutrain.trainer.ownership.identity_recipe` of the recipe as launched, before the memory
    fit changed it); default: this recipe's. ``placement``: the memory fit's decision
    (:class:`neutrain.memory.Placement`), which the trainer acts on; None: the recipe's memory keys.

    Example:
        >>> import tempfile
        >>> from neutrain.config import load_recipe
        >>> out = tempfile.mkdtemp()
        >>> ctx = build_trainer(load_recipe("default", ["train.max_steps=4", f"train.output_dir={out}"]))
        >>> type(ctx.trainer).__name__
        'NeuTrainer'
        >>> # four steps of the default model take about a minute on 2 CPU cores, so not run here:
        >>> ctx.trainer.train()  # doctest: +SKIP
    """
    from accelerate import PartialState

    from neutrain.data import Collator, build_datasets, pad_token_id  # lazy: `neutrain --help` stays instant
    from neutrain.trainer.modeling import build_model, build_tokenizer  # lazy: `neutrain --help` stays instant
    from neutrain.trainer.resume_check import check_resume, run_record  # lazy: `neutrain --help` stays instant
    from neutrain.trainer.trainer import NeuTrainer  # lazy: `neutrain --help` stays instant

    name_cpu_accelerator()  # a user's own loop calls this without train_from_recipe: no DeepSpeed GPU warning on CPU
    t = recipe.train
    out = t.output_dir
    state = PartialState(cpu=t.use_cpu)
    # memory.weights: auto, where no fit ran before (a trainer built from Python): resolved against this machine.
    recipe = settle_weights(recipe, logger.info if state.is_main_process else None, state.num_processes)
    preflight(recipe, state.num_processes)  # settings used late, and output_dir, fail before the model is built
    if state.is_main_process:
        warn_about_settings(recipe)  # e.g. a from-scratch learning rate on a pretrained model
    cache_dir = os.path.join(out, ".cache")
    if state.is_main_process:  # one run per output_dir (taken already when it existed: neutrain.trainer.run_state)
        from neutrain.storage.run_dir import claim, open_run  # lazy: `neutrain --help` stays instant
        from neutrain.storage.run_lock import ExportLock, RunLock  # lazy: `neutrain --help` stays instant
        from neutrain.trainer.ownership import identity_recipe  # lazy: `neutrain --help` stays instant

        RunLock(out).acquire()
        open_run(out, identity or identity_recipe(recipe))  # the run's identity, and the names it writes
        if recipe.export.format != "none":  # one run at a time writes an export directory
            # Its lock file sits beside the export and creates the folders above it: inside the run, they are the
            # run's from now (claimed at the export, after the training, a folder the lock had made was refused).
            claim(recipe.export_dir)
            ExportLock(recipe.export_dir, "export.output_dir" if recipe.export.output_dir else
                       "train.output_dir's export").acquire()
        claim(cache_dir)
    with state.main_process_first():
        tokenizer = build_tokenizer(recipe.model, recipe.data, out, cache_dir)
        check_long_context_prompts(tokenizer, recipe.eval)
        train_ds, heldout = build_datasets(recipe.data, tokenizer, cache_dir)
    if heldout is not None and recipe.eval.max_eval_samples:
        heldout = heldout.select(range(min(len(heldout), recipe.eval.max_eval_samples)))
    note = accumulation_note(len(train_ds) if hasattr(train_ds, "__len__") else None, t.micro_batch_size,
                             t.gradient_accumulation_steps, state.num_processes)
    if note is not None and state.is_main_process:
        logger.warning("%s", note)
    weights, adapter = recipe.memory.weights, recipe.memory.adapter
    if adapter:
        from neutrain.nn.lora import build_weights_for  # lazy: `neutrain --help` stays instant

        weights = build_weights_for(weights)  # a lossy base is built lossless, then rounded
    model = build_model(recipe.model, tokenizer, use_cpu=t.use_cpu, seed=t.seed, weights=weights,
                        offload_weights=recipe.memory.offload_weights, offload_layers=recipe.memory.offload_layers,
                        offload_slots=recipe.memory.offload_slots)
    check_vocabulary(model, tokenizer, "model.tokenizer")  # before a step indexes outside the embedding
    from neutrain.data.chat import trained_on_chat  # lazy: `neutrain --help` stays instant

    # As built (a class default, a GGUF file, a hub id): the positions every row and long-context prompt fits in.
    check_context(model.config, "model.config" if recipe.model.config is not None else "the model's config",
                  context_uses(recipe))
    check_sample_prompt(model, tokenizer, recipe.eval, trained_on_chat(recipe.data.datasets))  # sampled after training
    if adapter:
        from neutrain.nn.lora import apply_lora, compress_model_for_adapters  # lazy: `neutrain --help` stays instant

        model = compress_model_for_adapters(model, recipe.memory.weights)
        if not recipe.model.base_model and state.is_main_process:
            _save_adapter_base(model, tokenizer, out)
        model = apply_lora(model, recipe.memory)
    args = training_arguments(recipe, has_eval=heldout is not None)
    trainer = NeuTrainer(
        model=model, args=args, train_dataset=train_ds, eval_dataset=heldout, data_collator=Collator(pad_token_id(tokenizer)),
        processing_class=tokenizer, memory=recipe.memory, train=t,
        resume_reset_optimizer=t.resume_reset_optimizer, placement=placement,
    )
    from neutrain.data.sources import file_fingerprints  # lazy: `neutrain --help` stays instant

    train_sets = [entry for entry in recipe.data.datasets if entry["split"] == "train"]
    # In every checkpoint; a resume is checked against it (the data position: the launch and the data's bytes too).
    trainer.run_record = run_record(recipe, model, tokenizer, processes=state.num_processes,
                                    files=file_fingerprints(train_sets, cache_dir),
                                    base=_adapter_base(recipe, out) if adapter and state.is_main_process else None)
    if resume:  # the same model, weights format, optimizer, tokenizer and data as the checkpoint's run
        check_resume(resume, trainer.run_record, t.resume_reset_optimizer)
    if state.is_main_process:  # last: a run refused above leaves the recipe of the run it would have resumed
        _save_recipe(recipe, out)
    return RunContext(recipe, trainer, tokenizer, heldout, state)


def train_from_recipe(recipe: Recipe, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Train, evaluate and export as the recipe says; print and return a summary.

    The run holds ``train.output_dir``'s lock from start to end (:mod:`neutrain.storage.run_lock`):
    a second run there is refused in one line.

    Example:
        >>> from neutrain.config import load_recipe
        >>> # the whole default run (training, evaluation, export): minutes on a CPU, so not run here
        >>> summary = train_from_recipe(load_recipe("default", ["train.max_steps=4"]))  # doctest: +SKIP
    """
    from neutrain.storage.run_dir import close_run  # lazy: `neutrain --help` stays instant
    from neutrain.storage.run_lock import release, release_export  # lazy: `neutrain --help` stays instant
    from neutrain.trainer.signals import follow_launcher  # lazy: `neutrain --help` stays instant

    follow_launcher()  # a scheduler's SIGTERM to `accelerate launch` reaches this process too
    recipe = resolved_outputs(recipe)
    try:
        return _train_from_recipe(recipe, echo)
    finally:
        # No-ops where this process took none (other ranks, a refusal).
        release_export(recipe.export_dir)
        release(recipe.train.output_dir)
        close_run(recipe.train.output_dir)


def resolved_outputs(recipe: Recipe) -> Recipe:
    """``recipe`` with ``train.output_dir`` and ``export.output_dir`` resolved once, where a symlink is on their way
    (:func:`neutrain.trainer.ownership.note_resolved`): the run writes where they led at its start, to its end."""
    from neutrain.trainer.ownership import note_resolved  # lazy: `neutrain --help` stays instant

    train = recipe.train.changed(output_dir=note_resolved("train.output_dir", recipe.train.output_dir))
    export = recipe.export
    if export.output_dir:
        export = export.changed(output_dir=note_resolved("export.output_dir", export.output_dir, False))
    return recipe.with_sections(train=train, export=export)


def _train_from_recipe(recipe: Recipe, echo: Callable[[str], None]) -> dict[str, Any]:
    from accelerate import PartialState

    from neutrain.storage.refused_start import undone_if_refused  # lazy: `neutrain --help` stays instant
    from neutrain.trainer.ownership import identity_recipe, planned_names  # lazy: `neutrain --help` stays instant
    from neutrain.trainer.run_state import prepare_run  # lazy: `neutrain --help` stays instant
    from neutrain.memory import phase  # lazy: `neutrain --help` stays instant

    started = time.perf_counter()
    name_cpu_accelerator()  # before anything imports DeepSpeed: no GPU-detection warning on CPU runs
    out = recipe.train.output_dir
    # Before any process touches output_dir: processes a launch left on their own would each act as the main one.
    check_launch(PartialState(cpu=recipe.train.use_cpu).num_processes, _cuda_available())
    check_output_places(recipe)  # before anything is written: no output inside another run's checkpoint or export
    identity = identity_recipe(recipe)  # as launched: the memory fit below may change keys
    # Refused anywhere before the first step: the directory is left as this start found it.
    with undone_if_refused(out, active=PartialState(cpu=recipe.train.use_cpu).is_main_process):
        # Leftover temporaries cleared; a finished run is left exactly as it is (neutrain.trainer.run_state).
        plan = prepare_run(recipe.train, PartialState(cpu=recipe.train.use_cpu), identity, planned_names(recipe))
        if plan.finished:
            if PartialState().is_main_process:
                echo(plan.message)
            end_processes()
            return {"output_dir": out, "steps": plan.step, "finished": True, "checkpoint": plan.checkpoint,
                    "world_size": PartialState().num_processes}
        # A model this machine cannot hold at all is said as that, before the fit judges how long its steps would take.
        check_machine_holds(recipe)
        # Before anything is built: the configuration that fits memory.device_budget_gib, and its allocator limit.
        recipe, fit = fit_memory(recipe, PartialState(cpu=recipe.train.use_cpu), echo)
        with phase("build"):
            ctx = build_trainer(recipe, resume=plan.checkpoint, identity=identity,
                                placement=fit.placement if fit is not None else None)
        trainer, state = ctx.trainer, ctx.state
        if state.is_main_process and not plan.after_training:  # the room for every save and the export, before step 1
            check_run_disk(ctx, plan.step)
    if plan.after_training:  # trained to the end before; what came after did not complete
        if state.is_main_process:
            echo(plan.message)
        trainer.load_trained(plan.checkpoint)
        runtime = None
    else:
        _phase(state, echo, f"training: {recipe.train.max_steps} steps" if recipe.train.max_steps > 0 else "training")
        from neutrain.trainer.signals import StopOnSignal  # lazy: `neutrain --help` stays instant

        stopper = StopOnSignal()  # SIGTERM/SIGINT: save at the next step boundary, then stop (neutrain.trainer.signals)
        trainer.add_callback(stopper)
        with stopper.installed(), phase("train_step"):  # saves, resumes and evaluations inside are their own phases
            result = trainer.train(resume_from_checkpoint=plan.checkpoint)
        if stopper.signum is not None:
            end_processes(trainer.fused_optimizer)
            raise StoppedBySignal(stopper.stop_message(out), stopper.signum)
        runtime = result.metrics.get("train_runtime")
    from neutrain.trainer.signals import SignalDuringPhase, stopping_at_once  # lazy: `neutrain --help` stays instant

    stage = ["the phases after training"]  # what a signal interrupts, for its line

    def announce(name: str) -> None:
        stage[0] = name
        _phase(state, echo, name)

    try:
        # Nothing of these phases is kept half-done (the export is staged and renamed): a signal stops them at
        # once, and a relaunch finishes them from the last checkpoint (neutrain.trainer.run_state).
        with stopping_at_once():
            return after_training(ctx, fit, echo, announce, started, runtime)
    except SignalDuringPhase as stop:
        end_processes(trainer.fused_optimizer)
        raise StoppedBySignal(f"stopped by {stop.name} during {stage[0]}: the training is saved in "
                              f"{os.path.join(out, f'checkpoint-{trainer.state.global_step}')}; relaunch with "
                              f"train.resume_from_checkpoint=true to finish evaluation, export and the summary",
                              stop.signum) from None


def _keys_help() -> str:
    """Every recipe key with its default and help, from the section classes that also validate recipes."""
    lines = ["recipe keys (override any with section.key=value):"]
    for section, keys in SCHEMA.items():
        lines.append(f"  {section}:")
        for name, key in keys.items():
            default = "required" if key.default is not None and key.default.__class__ is object else repr(key.default)
            lines.append(textwrap.fill(f"{name} (default {default}): {key.help}", width=100, initial_indent="    ", subsequent_indent="        "))
    return "\n".join(lines)


def configure(p) -> None:
    """The ``train`` command's description, arguments and every recipe key (the epilog), on its subparser ``p``."""
    p.description = "Train, evaluate held-out perplexity, export and print a summary."
    p.epilog, p.formatter_class = _keys_help(), argparse.RawDescriptionHelpFormatter
    p.add_argument("recipe", help="recipe YAML file, or the name of a shipped recipe (see `neutrain recipes`)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.learning_rate=1e-5 train.max_steps=100")


def refuse_used_places(recipe: Recipe) -> None:
    """The refusals of the places a run writes that the files alone decide, before torch is imported.

    A place inside a checkpoint or an export, another run's directory or a folder no run wrote
    (:func:`~neutrain.trainer.ownership.refuse_used_directory`), an export directory that is no export.
    Why: these came only after torch and the Trainer had loaded, seconds later. Each is made again where the
    run makes it, and a relaunch of the same run is left to its resume plan.
    """
    from neutrain.trainer.ownership import identity_recipe, refuse_used_directory, same_run  # lazy: `neutrain --help` stays instant

    check_output_places(recipe)  # a place inside a checkpoint or an export is named as that first
    identity, out = identity_recipe(recipe), recipe.train.output_dir
    refuse_used_directory(out, identity, recipe.train.resume_from_checkpoint, recipe.train.overwrite_output_dir)
    if os.path.lexists(recipe.export_dir) and not same_run(out, identity):
        check_export_place(recipe)


def run(args) -> int:
    """Train ``args.recipe`` with ``args.overrides``: the whole default run (see :func:`train_from_recipe`)."""
    overrides = list(args.overrides)
    # `torchrun --nproc_per_node N -m neutrain <recipe>` on a CPU; the launch looked at first, torch only then
    # (a recipe that does not exist is refused before torch loads).
    chosen = any(o.split("=", 1)[0].strip() == "train.use_cpu" for o in overrides)  # the user's own choice stands
    if not chosen and cpu_processes(os.environ, cuda_available=False) and not _cuda_available():
        overrides.append("train.use_cpu=true")
    recipe = None
    if os.environ.get("WORLD_SIZE", "1") == "1":  # one process: under a launcher every process would look at once
        # The recipe's model config is checked against transformers' config class (which brings torch) only
        # after the places a run writes are refused; those do not depend on that check.
        try:
            light = load_recipe(args.recipe, overrides, shape_only=True)
        except UserInputError:
            light = None  # a bad recipe is said by the full load, with the line that names it best
        if light is not None:
            refuse_used_places(light)
            check_config_classes(light)  # the light recipe is now the full one: the file is read once
            recipe = light
    if recipe is None:
        recipe = load_recipe(args.recipe, overrides)
    args.writes_to = recipe.train.output_dir  # named by an environment error that carries no path
    # The command line trains on the device it finds; NeuTrainer in Python may still exercise the offload path on a CPU.
    check_weight_offload_device(recipe.memory, recipe.train.use_cpu, _cuda_available())
    summary = train_from_recipe(recipe)
    if summary.get("world_size", 1) > 1:
        exit_rank(0)  # no interpreter finalization for a finished rank (see exit_rank)
    return 0
