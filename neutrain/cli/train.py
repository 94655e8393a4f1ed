"""The default run: recipe -> model, data -> NeuTrainer -> evaluation -> export -> summary.

``neutrain train`` and ``accelerate launch -m neutrain`` call :func:`train_from_recipe`.
A run goes left to right and nothing reaches back (see the README's
architecture section).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
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
from neutrain.cli.distill import distill_from_recipe
from neutrain.cli.memory import fit_memory, phase_lines, phase_report
from neutrain.cli.preflight import check_long_context_prompts, preflight
from neutrain.distributed import end_processes, exit_rank
from neutrain.distributed.arguments import distributed_arguments
from neutrain.errors import StoppedBySignal

logger = logging.getLogger("neutrain")


def training_arguments(recipe: Recipe, has_eval: bool):
    """Map the recipe's ``train`` (and ``memory``) sections onto ``TrainingArguments``."""
    from transformers import TrainingArguments

    t, m = recipe.train, recipe.memory
    optim = {"adamw": "adamw_torch", "sgd": "sgd"}.get(t["optimizer"], "adamw_torch")
    kwargs: dict[str, Any] = dict(
        output_dir=t["output_dir"],
        per_device_train_batch_size=t["micro_batch_size"],
        per_device_eval_batch_size=recipe.eval_micro_batch_size,
        gradient_accumulation_steps=t["gradient_accumulation_steps"],
        learning_rate=t["learning_rate"],
        weight_decay=t["weight_decay"],
        adam_beta1=t["adam_beta1"],
        adam_beta2=t["adam_beta2"],
        lr_scheduler_type=t["lr_scheduler"],
        lr_scheduler_kwargs=t["lr_scheduler_kwargs"] or {},
        warmup_steps=t["warmup_steps"],
        num_train_epochs=t["num_epochs"],
        max_steps=t["max_steps"],
        max_grad_norm=t["max_grad_norm"],
        logging_steps=t["logging_steps"],
        save_strategy="steps",
        save_steps=t["save_steps"],
        save_total_limit=t["save_total_limit"],
        eval_strategy="steps" if (has_eval and t["eval_steps"]) else "no",
        eval_steps=t["eval_steps"],
        seed=t["seed"],
        data_seed=t["seed"],
        report_to=t["report_to"],
        dataloader_num_workers=t["dataloader_num_workers"],
        # Pinned host memory only helps copies to a GPU; without one torch warns on every loader.
        dataloader_pin_memory=not t["use_cpu"] and _cuda_available(),
        use_cpu=t["use_cpu"],
        optim=optim,
        remove_unused_columns=False,
        disable_tqdm=not progress_bars_wanted(),  # no bars in a log file or pipe (neutrain.compat.quiet)
        **distributed_arguments(t),
        save_safetensors=True,
        **compat.checkpointing_training_args(m["gradient_checkpointing"]),
    )
    return make_training_arguments(kwargs, TrainingArguments)


def _cuda_available() -> bool:
    import torch  # lazy: `neutrain --help` stays instant

    return torch.cuda.is_available()


def _phase(state, echo: Callable[[str], None], name: str) -> None:
    """Announce a phase of the run (main process only), so a user sees where the time goes."""
    if state.is_main_process:
        echo(f"\n== {name} ==")


def generate_sample(model, tokenizer, eval_cfg: dict, seed: int, chat: bool = False) -> str:
    """A continuation of ``eval.sample_prompt`` by the trained model, printed at the end of the run.

    Sampled (``eval.sample_temperature``, top-k 50, seeded) rather than greedy: a small model's greedy
    output repeats itself, which says less about what it learned. ``chat`` (a run on ``type: messages``
    data) sends the prompt through the chat template as one user turn, as the model was trained: sent raw,
    a chat fine-tune's sample was empty and the model looked broken although it had learned (issue 34).
    """
    import torch  # lazy: `neutrain --help` stays instant

    from neutrain.data.chat import prompt_ids, template_choice  # lazy: `neutrain --help` stays instant

    prompt = eval_cfg["sample_prompt"]
    device = next(model.parameters()).device
    use_template, _ = template_choice(tokenizer, chat)
    ids = torch.tensor([prompt_ids(tokenizer, prompt, raw=not use_template)], device=device)
    temperature = eval_cfg["sample_temperature"]
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 50} if temperature > 0 else {"do_sample": False}
    torch.manual_seed(seed)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=eval_cfg["sample_tokens"],
                             pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
                             **sampling)
    model.train(was_training)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    return f"user: {prompt}\nassistant: {answer}" if use_template else prompt + answer


def _save_recipe(recipe: Recipe, output_dir: str) -> None:
    path = Path(output_dir) / "recipe.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    from neutrain.storage.durable import write_durably  # lazy: `neutrain --help` stays instant

    # recipe.tmp<pid>: the name neutrain.storage.leftovers clears after a kill
    write_durably(path, yaml.safe_dump(recipe.to_dict(), sort_keys=False), tmp=path.with_suffix(f".tmp{os.getpid()}"))


ADAPTER_BASE = "base"
"""Where a LoRA run with no base directory (random init, a GGUF file) writes its frozen base, beside the checkpoints."""


def _save_adapter_base(model, tokenizer, out: str) -> None:
    """Write the frozen base of a LoRA run that has no base directory to ``<output_dir>/base`` (once).

    Why (issue 34): checkpoints hold only the adapters, and ``neutrain export <adapter checkpoint>`` needs the
    base they adapt; a random init or a GGUF file has no directory to name, so the export failed with "base
    model directory is unknown or missing (None)". The base is written as the adapters see it (lossy bases
    already rounded), in the dtype its weights are held in, so merging reproduces the trained model.
    """
    from neutrain.export import export_model  # lazy: `neutrain --help` stays instant

    path = Path(out) / ADAPTER_BASE
    if not (path / "config.json").exists():
        export_model(model, str(path), "hf", tokenizer=tokenizer, info={"name": "neutrain LoRA base (frozen)"}, overwrite=True)


class RunContext:
    """What :func:`build_trainer` assembles: the trainer, tokenizer, held-out data and process state."""

    def __init__(self, recipe: Recipe, trainer, tokenizer, heldout, state):
        self.recipe, self.trainer, self.tokenizer, self.heldout, self.state = recipe, trainer, tokenizer, heldout, state


def build_trainer(recipe: Recipe, resume: str | None = None) -> RunContext:
    """Build tokenizer, data, model and :class:`~neutrain.trainer.trainer.NeuTrainer` from a recipe, without training.

    ``resume``: the checkpoint the run will resume, refused (one line) when it was trained with another
    weights format, model shape, optimizer, tokenizer or dataset (:mod:`neutrain.trainer.resume_check`)
    before the recipe copy in ``output_dir`` is replaced.

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
    out = t["output_dir"]
    state = PartialState(cpu=t["use_cpu"])
    preflight(recipe, state.num_processes)  # settings used late, and output_dir, fail before the model is built
    if state.is_main_process:  # one run per output_dir (taken already when it existed: neutrain.trainer.run_state)
        from neutrain.storage.run_lock import RunLock  # lazy: `neutrain --help` stays instant

        RunLock(out).acquire()
    cache_dir = os.path.join(out, ".cache")
    with state.main_process_first():
        tokenizer = build_tokenizer(recipe.model, recipe.data, out, cache_dir)
        check_long_context_prompts(tokenizer, recipe.eval)
        train_ds, heldout = build_datasets(recipe.data, tokenizer, cache_dir)
    if heldout is not None and recipe.eval["max_eval_samples"]:
        heldout = heldout.select(range(min(len(heldout), recipe.eval["max_eval_samples"])))
    weights, adapter = recipe.memory["weights"], recipe.memory["adapter"]
    if adapter:
        from neutrain.nn.lora import build_weights_for  # lazy: `neutrain --help` stays instant

        weights = build_weights_for(weights)  # a lossy base is built lossless, then rounded
    model = build_model(recipe.model, tokenizer, use_cpu=t["use_cpu"], seed=t["seed"], weights=weights,
                        offload_weights=recipe.memory["offload_weights"])
    if adapter:
        from neutrain.nn.lora import apply_lora, compress_model_for_adapters  # lazy: `neutrain --help` stays instant

        model = compress_model_for_adapters(model, recipe.memory["weights"])
        if not recipe.model["base_model"] and state.is_main_process:
            _save_adapter_base(model, tokenizer, out)
        model = apply_lora(model, recipe.memory)
    args = training_arguments(recipe, has_eval=heldout is not None)
    trainer = NeuTrainer(
        model=model, args=args, train_dataset=train_ds, eval_dataset=heldout, data_collator=Collator(pad_token_id(tokenizer)),
        processing_class=tokenizer, memory=recipe.memory, train=t,
        resume_reset_optimizer=t["resume_reset_optimizer"],
    )
    trainer.run_record = run_record(recipe, model, tokenizer)  # in every checkpoint; a resume is checked against it
    if resume:  # the same model, weights format, optimizer, tokenizer and data as the checkpoint's run
        check_resume(resume, trainer.run_record, t["resume_reset_optimizer"])
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
    from neutrain.storage.run_lock import release  # lazy: `neutrain --help` stays instant

    try:
        return _train_from_recipe(recipe, echo)
    finally:
        release(recipe.train["output_dir"])  # a no-op where this process took none (other ranks, a refusal)


def _train_from_recipe(recipe: Recipe, echo: Callable[[str], None]) -> dict[str, Any]:
    from accelerate import PartialState

    from neutrain.data.chat import trained_on_chat  # lazy: `neutrain --help` stays instant
    from neutrain.trainer.run_state import prepare_run  # lazy: `neutrain --help` stays instant
    from neutrain.trainer.run_files import peak_memory_stats  # lazy: `neutrain --help` stays instant
    from neutrain.trainer.phases import phase  # lazy: `neutrain --help` stays instant

    started = time.perf_counter()
    name_cpu_accelerator()  # before anything imports DeepSpeed: no GPU-detection warning on CPU runs
    out = recipe.train["output_dir"]
    # Leftover temporaries cleared; a finished run is left exactly as it is (neutrain.trainer.run_state).
    plan = prepare_run(recipe.train, PartialState(cpu=recipe.train["use_cpu"]))
    if plan.finished:
        if PartialState().is_main_process:
            echo(plan.message)
        end_processes()
        return {"output_dir": out, "steps": plan.step, "finished": True, "checkpoint": plan.checkpoint,
                "world_size": PartialState().num_processes}
    # Before anything is built: the configuration that fits memory.device_budget_gib, and its allocator limit.
    recipe, fit = fit_memory(recipe, PartialState(cpu=recipe.train["use_cpu"]), echo)
    with phase("build"):
        ctx = build_trainer(recipe, resume=plan.checkpoint)
    trainer, tokenizer, heldout, state = ctx.trainer, ctx.tokenizer, ctx.heldout, ctx.state
    _phase(state, echo, f"training: {recipe.train['max_steps']} steps" if recipe.train["max_steps"] > 0 else "training")
    from neutrain.trainer.signals import StopOnSignal  # lazy: `neutrain --help` stays instant

    stopper = StopOnSignal()  # SIGTERM/SIGINT: save at the next step boundary, then stop (neutrain.trainer.signals)
    trainer.add_callback(stopper)
    with stopper.installed(), phase("train_step"):  # saves, resumes and evaluations inside are their own phases
        result = trainer.train(resume_from_checkpoint=plan.checkpoint)
    if stopper.signum is not None:
        end_processes(trainer.fused_optimizer)
        raise StoppedBySignal(stopper.stop_message(out), stopper.signum)
    summary: dict[str, Any] = {
        "output_dir": out, "steps": trainer.state.global_step, "world_size": trainer.args.world_size,
        "distributed_mode": trainer.distributed_mode.name,
        "model_wrapper": type(trainer.model_wrapped).__name__,
        "train_runtime_s": result.metrics.get("train_runtime"),
    }
    summary.update(loss_ends([h for h in trainer.state.log_history if "loss" in h]))
    tps = [h["tokens_per_second"] for h in trainer.state.log_history if "tokens_per_second" in h]
    if tps:
        summary["tokens_per_second"] = sum(tps) / len(tps)
    summary["nonfinite_skipped_steps"] = trainer.nonfinite_skipped_steps
    summary.update(peak_memory_stats())
    if recipe.eval["perplexity"] and heldout is not None:
        _phase(state, echo, "held-out evaluation")
        metrics = trainer.evaluate()
        summary["heldout_loss"] = metrics["eval_loss"]
        summary["heldout_perplexity"] = math.exp(min(metrics["eval_loss"], 50.0))
    mode = trainer.distributed_mode
    # Long-context evaluation, export and distillation run on the main process alone, which under FSDP2 and
    # ZeRO-3 holds only its shards of the model.
    sharded = mode.sharded
    if recipe.eval["long_context_tasks"] and sharded:
        logger.warning("eval.long_context_tasks skipped under %s (sharded weights): evaluate the export on one "
                       "process with `neutrain eval <export dir> --recipe <recipe>`", mode.name)
    elif recipe.eval["long_context_tasks"] and state.is_main_process:
        _phase(state, echo, "long-context evaluation: " + ", ".join(recipe.eval["kv_caches"]))
        with phase("eval"):
            summary["long_context"] = long_context_eval(trainer.model, tokenizer, recipe.eval, os.path.join(out, "eval"))
    chat = trained_on_chat(recipe.data["datasets"])  # recorded in the export: generation formats prompts alike
    export_format = recipe.export["format"]
    if export_format != "none" and mode.export_note:  # the checkpoints hold the model
        logger.warning("export skipped under %s", mode.export_note)
        export_format = "none"
    if export_format != "none":
        export_dir = recipe.export_dir
        _phase(state, echo, f"export: {recipe.export['format']}")
        with phase("export"), mode.gathered_weights(trainer.model):  # ZeRO-3: every rank gathers, the main process writes
            if state.is_main_process:
                from neutrain.export import export_model  # lazy: `neutrain --help` stays instant
                from neutrain.trainer.modeling import export_dtype  # lazy: `neutrain --help` stays instant

                dtype = export_dtype(recipe.model, recipe.memory["weights"], recipe.train["use_cpu"], recipe.export["dtype"])
                summary["export_dir"] = export_model(
                    trainer.model, export_dir, recipe.export["format"], overwrite=True,
                    tokenizer=tokenizer, max_shard_size=recipe.export["max_shard_size"], dtype=dtype,
                    info={"base_model": recipe.model["base_model"] or recipe.model["gguf_file"] or "random init", "recipe": recipe.source,
                          "chat_template": chat,
                          "steps": summary["steps"], "final_loss": summary.get("loss_last"),
                          "heldout_perplexity": summary.get("heldout_perplexity")},
                )
    if recipe.distill["enabled"] and sharded:
        logger.warning("distill skipped under %s (sharded weights): run it on one process from the export", mode.name)
    elif recipe.distill["enabled"] and state.is_main_process:
        _phase(state, echo, "distillation of a draft, then speculative decoding")
        summary["distill"] = distill_from_recipe(recipe, target=trainer.model, tokenizer=tokenizer)
    if recipe.eval["sample_prompt"] is not None and not sharded and state.is_main_process:
        _phase(state, echo, "sample")
        with phase("generate"):
            summary["sample"] = generate_sample(trainer.model, tokenizer, recipe.eval, recipe.train["seed"], chat=chat)
        summary["sample_chat_template"] = chat and bool(getattr(tokenizer, "chat_template", None))
    summary["wall_time_s"] = time.perf_counter() - started
    if state.is_main_process:
        from neutrain.storage.confine import check_output  # lazy: `neutrain --help` stays instant

        phase_report(summary, fit, out, trainer.state.global_step)
        check_output(Path(out) / "summary.json", out).write_text(json.dumps(summary, indent=2, default=str))
        echo(format_summary(summary))
    end_processes(trainer.fused_optimizer)  # before interpreter exit, where gloo's threads could abort
    return summary


def loss_ends(logged: list[dict]) -> dict[str, Any]:
    """The first and last logged training losses, each with the steps it averages.

    A logged loss is the mean over the steps since the previous log (``train.logging_steps``), so the
    summary says so: the first is not the loss of step 1 (issue 34).

    Example:
        >>> loss_ends([{"loss": 8.0, "step": 20}, {"loss": 5.0, "step": 40}, {"loss": 4.0, "step": 60}])
        {'loss_first': 8.0, 'loss_first_steps': '1-20', 'loss_last': 4.0, 'loss_last_steps': '41-60'}
    """
    if not logged:
        return {}

    def window(i: int) -> str:
        first = (logged[i - 1]["step"] if i else 0) + 1
        return str(first) if first == logged[i]["step"] else f"{first}-{logged[i]['step']}"

    return {"loss_first": logged[0]["loss"], "loss_first_steps": window(0),
            "loss_last": logged[-1]["loss"], "loss_last_steps": window(len(logged) - 1)}


def long_context_eval(model, tokenizer, eval_cfg: dict, out_dir: str) -> dict[str, Any]:
    """Run the recipe's long-context tasks once per KV cache; returns ``{cache: overall metrics}``.

    ShadowKV's sparse path normally starts at 4K-token prompts (the paper's setting); at the
    short lengths of a CPU run its threshold and outlier count are scaled down so that the
    compressed path really runs.
    """
    from neutrain.eval import evaluate  # lazy: `neutrain --help` stays instant

    results: dict[str, Any] = {}
    length = eval_cfg["context_len"]
    for cache in eval_cfg["kv_caches"]:
        options: dict[str, Any] = {}
        if cache == "shadowkv" and length < 4096:
            options = {"min_prefill": max(16, length // 4), "outliers": 2, "local_chunks": 2, "rank": 32}
        res = evaluate(model, tokenizer, eval_cfg["long_context_tasks"], kv=cache, length=length,
                       num_samples=eval_cfg["num_samples"], output_json=os.path.join(out_dir, f"long_context_{cache}.json"), **options)
        results[cache] = {k: v for k, v in res["overall"].items() if isinstance(v, (int, float, str))}
    return results


def format_summary(s: dict[str, Any]) -> str:
    """The short human summary printed at the end of a run."""
    lines = ["", "=== neutrain run summary ==="]
    if "loss_first" in s:
        lines.append(f"loss            {s['loss_first']:.4f} (mean of steps {s.get('loss_first_steps', '?')}) -> "
                     f"{s['loss_last']:.4f} (mean of steps {s.get('loss_last_steps', '?')}), {s['steps']} steps")
    if "heldout_perplexity" in s:
        lines.append(f"held-out        loss {s['heldout_loss']:.4f}, perplexity {s['heldout_perplexity']:.2f}")
    if "peak_memory_gib" in s:
        lines.append(f"peak memory     {s['peak_memory_gib']:.2f} GiB allocated, {s['peak_reserved_gib']:.2f} GiB reserved (GPU)")
    elif "peak_rss_gib" in s:
        lines.append(f"peak memory     {s['peak_rss_gib']:.2f} GiB process RSS (CPU)")
    if s.get("memory_fit"):
        lines.append(f"memory fit      {s['memory_fit']['line'].removeprefix('memory: ')}")
    lines.extend(phase_lines(s))
    if s.get("nonfinite_skipped_steps"):
        lines.append(f"non-finite      {s['nonfinite_skipped_steps']} optimizer steps had a non-finite loss or gradient (skipped)")
    if "tokens_per_second" in s:
        lines.append(f"throughput      {s['tokens_per_second']:.0f} tokens/s (training)")
    for cache, m in s.get("long_context", {}).items():
        lines.append(f"long context    {cache:<10} accuracy {m.get('accuracy', float('nan')):.1f}%, "
                     f"KV compression {m.get('compression_ratio', float('nan')):.2f}x, {m.get('tokens_per_s', float('nan')):.0f} tokens/s")
    if s.get("distill", {}).get("alpha") is not None:
        dd = s["distill"]
        lines.append(f"draft           alpha {dd['alpha_before']:.3f} -> {dd['alpha']:.3f}; speculative decode "
                     f"{dd['block_efficiency']:.2f} tokens per target call ({dd['draft_dir']})")
    lines.append(f"outputs         {s['output_dir']} (checkpoints, metrics.jsonl, training_curves.png)")
    if s.get("export_dir"):
        lines.append(f"export          {s['export_dir']}")
    lines.append(f"wall time       {s['wall_time_s']:.0f} s")
    if s.get("sample") is not None:
        how = ("answer to eval.sample_prompt, sent through the chat template" if s.get("sample_chat_template")
               else "continuation of eval.sample_prompt, sent raw")
        lines.append(f"sample          (the trained model's {how})")
        lines.extend("    " + line for line in s["sample"].splitlines())
    return "\n".join(lines)


def _keys_help() -> str:
    """Every recipe key with its default and help, from the schema table that also validates recipes."""
    lines = ["recipe keys (override any with section.key=value):"]
    for section, keys in SCHEMA.items():
        lines.append(f"  {section}:")
        for name, key in keys.items():
            default = "required" if key.default is not None and key.default.__class__ is object else repr(key.default)
            lines.append(textwrap.fill(f"{name} (default {default}): {key.help}", width=100, initial_indent="    ", subsequent_indent="        "))
    return "\n".join(lines)


def configure(sub) -> None:
    """Add the ``train`` command to the ``neutrain`` parser's subcommands."""
    p = sub.add_parser("train", help="train with a recipe (default when the first argument is a YAML file)",
                       description="Train, evaluate held-out perplexity, export and print a summary.",
                       epilog=_keys_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="recipe YAML file, or the name of a shipped recipe (see `neutrain recipes`)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.learning_rate=1e-5 train.max_steps=100")


def run(args) -> int:
    """Train ``args.recipe`` with ``args.overrides``: the whole default run (see :func:`train_from_recipe`)."""
    recipe = load_recipe(args.recipe, args.overrides)
    args.writes_to = recipe.train["output_dir"]  # named by an environment error that carries no path
    summary = train_from_recipe(recipe)
    if summary.get("world_size", 1) > 1:
        exit_rank(0)  # no interpreter finalization for a finished rank (see exit_rank)
    return 0
