"""Long-context evaluation with full, MiniCache or ShadowKV KV caches.

``evaluate`` is what ``NeuTrainer.evaluate`` and ``neutrain eval`` call. It works
on CPU at small lengths (tiny models, a few hundred tokens) as well as on GPU at
long ones. ShadowKV only compresses prompts of at least ``min_prefill`` tokens
(paper: 4096); pass a smaller ``min_prefill`` (and ``outliers``) for short
prompts, otherwise the result's ``counters["dense_prefill"]`` shows the fallback.

Example:
    >>> import transformers
    >>> from neutrain.eval import evaluate
    >>> from neutrain.eval.tasks import char_tokenizer
    >>> tok = char_tokenizer()
    >>> cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    ...                                num_key_value_heads=2, intermediate_size=128, vocab_size=len(tok))
    >>> model = transformers.AutoModelForCausalLM.from_config(cfg)
    >>> res = evaluate(model, tok, ["niah_single"], kv="minicache", length=512, num_samples=1)
    >>> sorted(res["tasks"]) == ["niah_single"] and res["overall"]["counters"]["merges"] > 0
    True
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Iterable

from .kv.registry import kv_cache_spec
from .perplexity import perplexity_record
from .tasks import TASKS, Sample, char_tokenizer, generate_task

__all__ = ["evaluate", "TASKS", "Sample", "generate_task", "char_tokenizer", "format_table", "perplexity"]


def __getattr__(name: str):
    # The loop's table is imported on first access (PEP 562): the package root reads the KV cache registry
    # (neutrain.eval.kv.registry), which must not import torch, and importing it runs this file first.
    if name != "format_table":
        raise AttributeError(f"module 'neutrain.eval' has no attribute {name!r}")
    value = importlib.import_module("neutrain.eval.loop").format_table
    globals()[name] = value
    return value


def perplexity(model, tokenizer, texts: Iterable[str], max_length: int = 1024) -> float:
    """Token-level perplexity of ``texts`` with full attention: :func:`neutrain.eval.loop.perplexity`.

    Defined after the submodule of the same name is imported (above), so that this name stays the function.
    """
    # lazy: the loop brings torch, which importing this package must not
    from .loop import perplexity as loop_perplexity

    return loop_perplexity(model, tokenizer, texts, max_length)


def _samples(tasks, tokenizer, length: int, num_samples: int, seed: int) -> dict[str, list[Sample]]:
    if isinstance(tasks, str):
        tasks = [tasks]
    if isinstance(tasks, dict):
        return {name: list(samples) for name, samples in tasks.items()}
    out: dict[str, list[Sample]] = {}
    for task in tasks:
        if isinstance(task, Sample):
            out.setdefault(task.task, []).append(task)
        else:
            out[task] = generate_task(task, tokenizer, length, num_samples, seed)
    return out


def evaluate(model, tokenizer, tasks: Iterable[str] | dict[str, list[Sample]] | str = ("niah_single",),
             kv: str = "full", *, length: int = 4096, num_samples: int = 4, seed: int = 42,
             ppl_texts: Iterable[str] | None = None, ppl_max_length: int = 1024, fidelity: bool = False,
             output_json: str | Path | None = None, **kv_options) -> dict[str, Any]:
    """Evaluate ``model`` on long-context tasks with the KV cache ``kv``.

    Args:
        model: A causal LM (any device; samples run one at a time, batch 1).
        tokenizer: Its tokenizer; task lengths are counted in its tokens.
        tasks: Task names from :data:`TASKS`, ``Sample`` objects, or ``{name: [Sample, ...]}``.
        kv: a registered cache (:mod:`neutrain.eval.kv.registry`): ``"full"`` (``DynamicCache``),
            ``"minicache"``, ``"shadowkv"``, a baseline, or one of your own.
        length: Total tokens per sample (prompt + answer budget) for generated tasks.
        num_samples: Samples per generated task.
        seed: Generator seed (RULER default 42).
        ppl_texts: Held-out texts for perplexity (full attention, teacher forced).
        ppl_max_length: Truncation for perplexity texts.
        fidelity: Also decode with the full cache and report next-token KL and top-1
            agreement of ``kv`` against it, teacher-forced on the full cache's tokens.
        output_json: Write the results there (tensors dropped).
        **kv_options: Passed to the cache's factory (``MiniCache(...)``, ``enable_shadowkv(...)``).

    Returns:
        ``{"kv", "options", "tasks": {task: metrics}, "overall": metrics, "perplexity", "perplexity_loss", "table",
        "per_sample"}``;
        metrics hold ``accuracy`` (exact match, %), ``partial`` (RULER string_match_all, %),
        ``tokens_per_s``, ``kv_device_bytes``, ``kv_host_bytes``, ``compression_ratio``
        (full bytes / device bytes, measured), ``peak_gpu_bytes`` and the cache ``counters``.
    """
    # lazy: the loop brings torch, which importing this package must not
    from .loop import format_table, kv_cache_factory, mean_loss, run_tasks, write_json

    kv_cache_spec(kv)  # an unknown cache is refused before the model is touched
    was_training = model.training
    model.eval()
    try:
        samples = _samples(tasks, tokenizer, length, num_samples, seed)
        reference = None
        if fidelity and kv != "full":
            with kv_cache_factory(model, "full") as make_full:
                reference = run_tasks(model, tokenizer, samples, make_full, keep_logits=True)["per_sample"]
        with kv_cache_factory(model, kv, **kv_options) as make_cache:
            results = run_tasks(model, tokenizer, samples, make_cache, reference=reference)
        loss = mean_loss(model, tokenizer, ppl_texts, ppl_max_length) if ppl_texts else None
        results["perplexity_loss"] = loss  # printed beside the perplexity (neutrain.eval.perplexity)
        results["perplexity"] = None if loss is None else perplexity_record(loss)  # null past its bound
    finally:
        model.train(was_training)
    results = {"kv": kv, "options": dict(kv_options), **results}
    results["table"] = format_table(results)
    if output_json is not None:
        write_json(results, output_json)
    return results
