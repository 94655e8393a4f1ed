"""The phases of a run after its training: evaluation, export, distillation, the sample and the summary.

``neutrain train`` runs them once the last step is saved (:func:`after_training`), and again, on
the loaded last checkpoint, when a relaunch finds they did not complete: the summary, written last
and synced, is what marks a run finished (:func:`neutrain.trainer.run_state.summarised`).

Example:
    >>> loss_ends([{"loss": 8.0, "step": 20}, {"loss": 5.0, "step": 40}])["loss_last_steps"]
    '21-40'
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from neutrain.distill.draft import distill_from_recipe, payoff_words
from neutrain.cli.memory import phase_lines, phase_report
from neutrain.config.schema import Recipe
from neutrain.distributed import end_processes
from neutrain.errors import UserInputError
from neutrain.storage.run_lock import previous_checkpoints

if TYPE_CHECKING:  # annotations only: the classes are not needed at run time
    from neutrain.config.after_training_sections import EvalSection

logger = logging.getLogger("neutrain")


class NothingTrained(UserInputError):
    """Every optimizer step of the run was skipped for a non-finite loss or gradient."""


class RunContext:
    """What :func:`neutrain.cli.train.build_trainer` assembles: the trainer, tokenizer, held-out data and process state."""

    def __init__(self, recipe: Recipe, trainer, tokenizer, heldout, state):
        self.recipe, self.trainer, self.tokenizer, self.heldout, self.state = recipe, trainer, tokenizer, heldout, state


def generate_sample(model, tokenizer, eval_cfg: EvalSection, seed: int, chat: bool = False) -> str:
    """A continuation of ``eval.sample_prompt`` by the trained model, printed at the end of the run.

    Sampled (``eval.sample_temperature``, top-k 50, seeded) rather than greedy: a small model's greedy
    output repeats itself, which says less about what it learned. ``chat`` (a run on ``type: messages``
    data) sends the prompt through the chat template as one user turn, as the model was trained: sent raw,
    a chat fine-tune's sample was empty and the model looked broken although it had learned.
    """
    import torch  # lazy: `neutrain --help` stays instant

    from neutrain.data.chat import prompt_ids, template_choice  # lazy: `neutrain --help` stays instant

    prompt = eval_cfg.sample_prompt
    device = next(model.parameters()).device
    use_template, _ = template_choice(tokenizer, chat)
    ids = torch.tensor([prompt_ids(tokenizer, prompt, raw=not use_template)], device=device)
    temperature = eval_cfg.sample_temperature
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 50} if temperature > 0 else {"do_sample": False}
    torch.manual_seed(seed)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=eval_cfg.sample_tokens,
                             pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
                             **sampling)
    model.train(was_training)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    return f"user: {prompt}\nassistant: {answer}" if use_template else prompt + answer




def after_training(ctx: RunContext, fit, echo: Callable[[str], None], announce: Callable[[str], None],
                    started: float, runtime: float | None) -> dict[str, Any]:
    """Evaluate, export, distil, sample and summarise a trained run; ``summary.json`` last (it marks the run done).

    ``runtime`` is the training's, None when the run was relaunched after its training (weights loaded).
    """
    from neutrain.data.chat import trained_on_chat  # lazy: `neutrain --help` stays instant
    from neutrain.trainer.run_files import peak_memory_stats  # lazy: `neutrain --help` stays instant
    from neutrain.memory import phase  # lazy: `neutrain --help` stays instant

    recipe, trainer, tokenizer, heldout, state = ctx.recipe, ctx.trainer, ctx.tokenizer, ctx.heldout, ctx.state
    out = recipe.train.output_dir
    summary: dict[str, Any] = {
        "output_dir": out, "steps": trainer.state.global_step, "world_size": trainer.args.world_size,
        "distributed_mode": trainer.distributed_mode.name,
        "model_wrapper": type(trainer.model_wrapped).__name__,
        "train_runtime_s": runtime,
    }
    summary.update(loss_ends([h for h in trainer.state.log_history if "loss" in h]))
    summary.update(throughput(trainer.state.log_history))
    summary["nonfinite_skipped_steps"] = trainer.nonfinite_skipped_steps
    if summary["steps"] and summary["nonfinite_skipped_steps"] >= summary["steps"]:
        # An untrained model must not be evaluated, exported and summarised as if it were the run's result.
        end_processes(trainer.fused_optimizer)
        raise NothingTrained(f"every one of the {summary['steps']} training steps had a non-finite loss or gradient and "
                             f"changed no weight: the model is untrained, so it is neither evaluated nor exported (the "
                             f"checkpoints in {out} hold the untrained weights); lower train.learning_rate or check "
                             f"the data")
    summary.update(peak_memory_stats())
    if trainer.memory.offload_activations or trainer.memory.offload_weights:  # the host's share, for its budget
        summary["host_memory"] = trainer.host_memory()
    mode = trainer.distributed_mode
    # Long-context evaluation, export and distillation run on the main process alone, which under FSDP2 and
    # ZeRO-3 holds only its shards of the model.
    sharded = mode.sharded
    if recipe.eval.perplexity and heldout is not None and sharded and runtime is None:
        # Relaunched after its training: the weights were never sharded by a training start, only loaded.
        logger.warning("held-out evaluation skipped: the run was relaunched after its training under %s (sharded "
                       "weights); evaluate its last checkpoint with `neutrain eval` on one process", mode.name)
    elif recipe.eval.perplexity and heldout is not None:
        announce("held-out evaluation")
        metrics = trainer.evaluate()
        summary["heldout_loss"] = metrics["eval_loss"]
        from neutrain.eval.perplexity import perplexity_record  # lazy: the eval package brings torch

        summary["heldout_perplexity"] = perplexity_record(metrics["eval_loss"])  # null past its bound (eval.perplexity)
    if recipe.eval.long_context_tasks and sharded:
        logger.warning("eval.long_context_tasks skipped under %s (sharded weights): evaluate the export on one "
                       "process with `neutrain eval <export dir> --recipe <recipe>`", mode.name)
    elif recipe.eval.long_context_tasks and state.is_main_process:
        announce("long-context evaluation: " + ", ".join(recipe.eval.kv_caches))
        from neutrain.storage.run_dir import claim  # lazy: `neutrain --help` stays instant

        claim(os.path.join(out, "eval"))
        with phase("eval"):
            summary["long_context"] = long_context_eval(trainer.model, tokenizer, recipe.eval, os.path.join(out, "eval"))
    chat = trained_on_chat(recipe.data.datasets)  # recorded in the export: generation formats prompts alike
    export_format = recipe.export.format
    if export_format != "none" and mode.export_note:  # the checkpoints hold the model
        logger.warning("export skipped under %s", mode.export_note)
        export_format = "none"
    if export_format != "none":
        export_dir = recipe.export_dir
        announce(f"export: {recipe.export.format}")
        with phase("export"), mode.gathered_weights(trainer.model):  # ZeRO-3: every rank gathers, the main process writes
            if state.is_main_process:
                from neutrain.export import export_model  # lazy: `neutrain --help` stays instant
                from neutrain.trainer.modeling import export_dtype  # lazy: `neutrain --help` stays instant

                from neutrain.cli.export import source_record  # lazy: `neutrain --help` stays instant

                dtype = export_dtype(recipe.model, recipe.memory.weights, recipe.train.use_cpu, recipe.export.dtype)
                # The run and its last checkpoint, by content: a later command can tell when that path holds other weights.
                source = source_record(Path(out) / f"checkpoint-{summary['steps']}")
                summary["export_dir"] = export_model(
                    trainer.model, export_dir, recipe.export.format, overwrite=True,
                    tokenizer=tokenizer, max_shard_size=recipe.export.max_shard_size, dtype=dtype,
                    info={"base_model": recipe.model.base_model or recipe.model.gguf_file or "random init", "recipe": recipe.source,
                          "chat_template": chat, **source,
                          "steps": summary["steps"], "final_loss": summary.get("loss_last"),
                          "heldout_perplexity": summary.get("heldout_perplexity")},
                )
    if recipe.distill.enabled and sharded:
        logger.warning("distill skipped under %s (sharded weights): run it on one process from the export", mode.name)
    elif recipe.distill.enabled and state.is_main_process:
        announce("distillation of a draft, then speculative decoding")
        # A continued run replaces its own earlier draft, as it replaces its own export.
        summary["distill"] = distill_from_recipe(recipe, target=trainer.model, tokenizer=tokenizer, overwrite=True)
    if recipe.eval.sample_prompt is not None and not sharded and state.is_main_process:
        announce("sample")
        with phase("generate"):
            summary["sample"] = generate_sample(trainer.model, tokenizer, recipe.eval, recipe.train.seed, chat=chat)
        summary["sample_chat_template"] = chat and bool(getattr(tokenizer, "chat_template", None))
    summary["wall_time_s"] = time.perf_counter() - started
    if state.is_main_process:
        from neutrain.storage.confine import check_output  # lazy: `neutrain --help` stays instant

        phase_report(summary, fit, out, trainer.state.global_step)
        from neutrain.storage.durable import write_durably  # lazy: `neutrain --help` stays instant
        from neutrain.trainer.run_state import SUMMARY  # lazy: `neutrain --help` stays instant

        from neutrain.storage.run_dir import claim  # lazy: `neutrain --help` stays instant

        claim(Path(out) / SUMMARY)
        # Last, and on the disk: it marks every phase done, so a relaunch finds the run finished.
        write_durably(check_output(Path(out) / SUMMARY, out), json.dumps(summary, indent=2, default=str))
        echo(format_summary(summary))
    end_processes(trainer.fused_optimizer)  # before interpreter exit, where gloo's threads could abort
    return summary


def throughput(log_history: list[dict]) -> dict[str, Any]:
    """The run's training throughput: every logged window's tokens over their seconds (resumed launches included).

    Not the mean of the windows' rates, which weighs a window slowed by a save or a busy machine as much as a
    fast one: rates of 300 and 100 tokens/s over 10 and 30 s are 6,000 tokens in 40 s, 150 tokens/s, not 200.

    Example:
        >>> throughput([{"window_tokens": 3000, "window_seconds": 10.0}, {"window_tokens": 3000, "window_seconds": 30.0}])
        {'tokens_per_second': 150.0, 'tokens_trained': 6000, 'training_seconds': 40.0}
    """
    windows = [(h["window_tokens"], h["window_seconds"]) for h in log_history if h.get("window_seconds")]
    if not windows:
        return {}
    tokens, seconds = sum(t for t, _ in windows), sum(s for _, s in windows)
    return {"tokens_per_second": tokens / seconds, "tokens_trained": tokens, "training_seconds": seconds}


def loss_ends(logged: list[dict]) -> dict[str, Any]:
    """The first and last logged training losses, each with the steps it averages.

    A logged loss is the mean over the steps since the previous log (``train.logging_steps``), so the
    summary says so: the first is not the loss of step 1.

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


def long_context_eval(model, tokenizer, eval_cfg: EvalSection, out_dir: str) -> dict[str, Any]:
    """Run the recipe's long-context tasks once per KV cache; returns ``{cache: overall metrics}``.

    ShadowKV's sparse path normally starts at 4K-token prompts (the paper's setting); at the
    short lengths of a CPU run its threshold and outlier count are scaled down so that the
    compressed path really runs.
    """
    from neutrain.eval import evaluate  # lazy: `neutrain --help` stays instant

    results: dict[str, Any] = {}
    length = eval_cfg.context_len
    for cache in eval_cfg.kv_caches:
        options: dict[str, Any] = {}
        if cache == "shadowkv" and length < 4096:
            options = {"min_prefill": max(16, length // 4), "outliers": 2, "local_chunks": 2, "rank": 32}
        res = evaluate(model, tokenizer, eval_cfg.long_context_tasks, kv=cache, length=length,
                       num_samples=eval_cfg.num_samples, output_json=os.path.join(out_dir, f"long_context_{cache}.json"), **options)
        results[cache] = {k: v for k, v in res["overall"].items() if isinstance(v, (int, float, str))}
    return results


def _outputs_left(out: str) -> list[str]:
    """What the run left in ``out``, by name: a run that saved no checkpoint is said to have saved none."""
    saved = previous_checkpoints(out) if os.path.isdir(out) else []
    if len(saved) > 3:
        saved = [f"{len(saved)} checkpoints ({saved[0]} to {saved[-1]})"]
    files = [name for name in ("metrics.jsonl", "training_curves.png") if os.path.isfile(os.path.join(out, name))]
    return [*(saved or ["no checkpoint saved"]), *files]


def format_summary(s: dict[str, Any]) -> str:
    """The short human summary printed at the end of a run."""
    lines = ["", "=== neutrain run summary ==="]
    if "loss_first" in s:
        lines.append(f"loss            {s['loss_first']:.4f} (mean of steps {s.get('loss_first_steps', '?')}) -> "
                     f"{s['loss_last']:.4f} (mean of steps {s.get('loss_last_steps', '?')}), {s['steps']} steps")
    if "heldout_loss" in s:
        from neutrain.eval.perplexity import perplexity_text  # lazy: the eval package brings torch

        lines.append(f"held-out        {perplexity_text(s['heldout_loss'])}")
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
        total = (f": {s['tokens_trained']:,} tokens in {s['training_seconds']:.0f} s" if "tokens_trained" in s else "")
        lines.append(f"throughput      {s['tokens_per_second']:.0f} tokens/s (training{total})")
    for cache, m in s.get("long_context", {}).items():
        lines.append(f"long context    {cache:<10} accuracy {m.get('accuracy', float('nan')):.1f}%, "
                     f"KV compression {m.get('compression_ratio', float('nan')):.2f}x, {m.get('tokens_per_s', float('nan')):.0f} tokens/s")
    if s.get("distill", {}).get("alpha") is not None:
        dd = s["distill"]
        lines.append(f"draft           alpha {dd['alpha_before']:.3f} -> {dd['alpha']:.3f}; speculative decode "
                     f"{payoff_words(dd)} ({dd['draft_dir']})")
    lines.append(f"outputs         {s['output_dir']} ({', '.join(_outputs_left(s['output_dir']))})")
    if s.get("export_dir"):
        lines.append(f"export          {s['export_dir']}")
    lines.append(f"wall time       {s['wall_time_s']:.0f} s")
    if s.get("sample") is not None:
        how = ("answer to eval.sample_prompt, sent through the chat template" if s.get("sample_chat_template")
               else "continuation of eval.sample_prompt, sent raw")
        lines.append(f"sample          (the trained model's {how})")
        lines.extend("    " + line for line in s["sample"].splitlines())
    return "\n".join(lines)
