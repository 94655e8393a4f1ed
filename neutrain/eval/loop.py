"""The evaluation loop: perplexity, generation tasks with a selectable KV cache, and fidelity.

Decoding is a plain greedy loop over ``model(...)`` rather than ``generate``, so
that the cache object, the timing and the per-step logits are under our control
and the loop works the same on transformers 5.17 and the newest 5.x (the cache
keyword comes from :mod:`neutrain.compat`).

Scoring follows RULER: ``partial`` is ``string_match_all`` (the fraction of the
references found, case-insensitive, in the generation); ``accuracy`` is the
exact-match rate, a sample counting only if every reference is present.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from neutrain.decode.engine import DecodeEngine
from neutrain.eval.kv.registry import kv_cache_spec
from neutrain.eval.perplexity import perplexity_of, perplexity_text

from .. import compat
from .tasks import Sample


# ---------------------------------------------------------------- caches
def kv_cache_factory(model, kv: str, **kv_options):
    """A context yielding a zero-argument function that makes a fresh cache of kind ``kv`` for ``model``:
    the registered cache ``kv``'s factory (:mod:`neutrain.eval.kv.registry`), given ``kv_options`` over the
    spec's own. ShadowKV and MiniCache switch the model's attention implementation for the duration of the block.
    """
    return kv_cache_spec(kv).open(model, **kv_options)


@contextmanager
def full_cache_factory(model):
    """The full cache: transformers' ``DynamicCache``, every key and value kept."""
    from transformers import DynamicCache

    yield lambda: DynamicCache(config=model.config)


def cache_bytes(cache) -> dict[str, float]:
    """Device bytes, host bytes, full-cache bytes and measured ratio of any of our caches."""
    if hasattr(cache, "stats"):
        stats = cache.stats()
        device = stats.get("device_bytes", stats.get("stored_bytes", 0))
        return {"device_bytes": device, "host_bytes": stats.get("host_bytes", 0),
                "full_bytes": stats["full_bytes"], "compression_ratio": stats["compression_ratio"]}
    device = sum(
        layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        for layer in cache.layers if getattr(layer, "keys", None) is not None
    )
    return {"device_bytes": device, "host_bytes": 0, "full_bytes": device, "compression_ratio": 1.0}


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- decoding
@torch.inference_mode()
def greedy_decode(model, input_ids: torch.Tensor, max_new_tokens: int, cache, eos_token_id: int | None = None,
                  forced_tokens: torch.Tensor | None = None, keep_logits: bool = False) -> dict[str, Any]:
    """Greedy decoding with an explicit cache.

    Args:
        model: A causal LM.
        input_ids: [b, n] prompt (no padding).
        max_new_tokens: Tokens to generate.
        cache: A fresh transformers ``Cache``.
        eos_token_id: Stop when every row produced it.
        forced_tokens: [b, t] tokens to feed instead of the argmax (teacher forcing), for fidelity.
        keep_logits: Return the next-token logits of every step ([b, steps, vocab], fp32, CPU).

    Returns:
        ``tokens`` [b, steps], ``prefill_s``, ``decode_s``, ``logits`` (optional), ``cache``.
    """
    kwarg = compat.cache_forward_kwarg(model)
    device = input_ids.device
    steps = max_new_tokens if forced_tokens is None else forced_tokens.shape[1]
    _sync(device)
    start = time.perf_counter()
    out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{kwarg: cache})
    _sync(device)
    prefill_s = time.perf_counter() - start
    tokens, logits = [], []
    start = time.perf_counter()
    for step in range(steps):
        next_logits = out.logits[:, -1].float()
        if keep_logits:
            logits.append(next_logits.cpu())
        token = next_logits.argmax(-1) if forced_tokens is None else forced_tokens[:, step]
        tokens.append(token)
        if forced_tokens is None and eos_token_id is not None and bool((token == eos_token_id).all()):
            break
        if step + 1 < steps:
            out = model(input_ids=token[:, None], use_cache=True, **{kwarg: cache})
    _sync(device)
    decode_s = time.perf_counter() - start
    result = {"tokens": torch.stack(tokens, 1), "prefill_s": prefill_s, "decode_s": decode_s, "cache": cache}
    if keep_logits:
        result["logits"] = torch.stack(logits, 1)
    return result


@torch.inference_mode()
def engine_greedy_decode(engine, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None,
                         keep_logits: bool = False) -> dict[str, Any]:
    """:func:`greedy_decode` for the full cache, in a :class:`~neutrain.decode.engine.DecodeEngine`.

    The engine's static cache and one CUDA graph per token (on a GPU) take the host out of the decode
    step; its greedy tokens equal Hugging Face's (tests/unit/decode/test_engine.py). One engine
    serves every sample whose prompt plus new tokens fit its ``max_len`` (``prefill`` starts over), so
    the graph is captured once per run. Returns the same keys as :func:`greedy_decode`; ``cache`` is
    the engine's ``StaticCache`` (its bytes are the whole preallocated ``max_len``).
    """
    device = input_ids.device
    n = input_ids.shape[1]
    if n + max_new_tokens > engine.max_len:
        raise ValueError(f"{n} prompt + {max_new_tokens} new tokens do not fit the engine's max_len={engine.max_len}")
    _sync(device)
    start = time.perf_counter()
    engine.prefill(input_ids, temperature=0.0)
    _sync(device)
    prefill_s = time.perf_counter() - start
    # .float().cpu() of the engine's fp32 buffer on a CPU model is the buffer itself: clone each step's logits
    logits = [engine.logits.float().cpu().clone()] if keep_logits else []
    start = time.perf_counter()
    if keep_logits:  # fidelity needs every step's logits: one transfer per step, reference runs only
        for _ in range(1, max_new_tokens):
            engine.step()
            logits.append(engine.logits.float().cpu().clone())
    else:
        engine.decode_after_prefill(n, max_new_tokens, eos_token_id)
    tokens = engine.tokens[:, n : engine.host_length + 1].clone()
    _sync(device)
    decode_s = time.perf_counter() - start
    if eos_token_id is not None:  # as greedy_decode: stop after the step where every row has produced EOS
        done = (tokens == eos_token_id).cumsum(1).clamp(max=1).all(0)
        if bool(done.any()):
            tokens = tokens[:, : int(done.long().argmax()) + 1]
    result = {"tokens": tokens, "prefill_s": prefill_s, "decode_s": decode_s, "cache": engine.cache}
    if keep_logits:
        result["logits"] = torch.stack(logits, 1)[:, : tokens.shape[1]]
    return result


def score(prediction: str, answers: list[str]) -> tuple[float, float]:
    """(exact, partial): all references found / fraction found, case-insensitive substrings (RULER)."""
    text = prediction.lower()
    found = [ans.lower() in text for ans in answers]
    return float(all(found)), sum(found) / len(found)


def next_token_fidelity(reference_logits: torch.Tensor, logits: torch.Tensor) -> dict[str, float]:
    """Mean KL(reference || candidate) of next-token distributions and top-1 agreement."""
    ref = torch.log_softmax(reference_logits.float(), -1)
    cand = torch.log_softmax(logits.float(), -1)
    kl = (ref.exp() * (ref - cand)).sum(-1)
    agree = (reference_logits.argmax(-1) == logits.argmax(-1)).float()
    return {"kl": kl.mean().item(), "top1_agreement": agree.mean().item()}


# ---------------------------------------------------------------- perplexity
@torch.inference_mode()
def perplexity(model, tokenizer, texts: Iterable[str], max_length: int = 1024) -> float:
    """Token-level perplexity of ``texts`` (each truncated to ``max_length`` tokens), full attention:
    :func:`neutrain.eval.perplexity.perplexity_of` of :func:`mean_loss`."""
    return perplexity_of(mean_loss(model, tokenizer, texts, max_length))


@torch.inference_mode()
def mean_loss(model, tokenizer, texts: Iterable[str], max_length: int = 1024) -> float:
    """Mean next-token loss (nats) over the tokens of ``texts`` (each truncated to ``max_length``); NaN for none."""
    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][:, :max_length].to(device)
        if ids.shape[1] < 2:
            continue
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
        total_nll += nll.item()
        total_tokens += ids.shape[1] - 1
    return total_nll / total_tokens if total_tokens else float("nan")


# ---------------------------------------------------------------- task loop
def _full_cache_engine(model, make_cache: Callable[[], Any], samples_by_task: dict[str, list[Sample]],
                       prompts: dict[str, list[torch.Tensor]]):
    """A :class:`~neutrain.decode.engine.DecodeEngine` long enough for every sample, when ``make_cache`` makes
    the plain full cache and the engine can hold the model (full-attention layers); else None."""
    from transformers import (
        DynamicCache,  # lazy: transformers, only when a cache is built
    )

    if type(make_cache()) is not DynamicCache:  # a compressed cache: its own class decodes
        return None
    longest = max((p.shape[1] + s.max_new_tokens for task, ss in samples_by_task.items()
                   for p, s in zip(prompts[task], ss)), default=0)
    try:
        return DecodeEngine(model, max_len=max(longest, 2))
    except ValueError:  # sliding-window layers, or a transformers release without a device-side length
        return None


def run_tasks(model, tokenizer, samples_by_task: dict[str, list[Sample]], make_cache: Callable[[], Any],
              reference: dict | None = None, keep_logits: bool = False, use_engine: bool = True) -> dict[str, Any]:
    """Decode every sample with a fresh cache from ``make_cache``; aggregate per task.

    The full cache (a plain ``DynamicCache``) decodes in the :class:`~neutrain.decode.engine.DecodeEngine`
    (static cache, a CUDA graph per token on a GPU) unless ``use_engine`` is False; greedy tokens are the
    same either way.

    ``reference`` (the ``per_sample`` output of a full-cache run with ``keep_logits``)
    turns on teacher-forced fidelity: the candidate cache is fed the reference's
    tokens and its next-token logits are compared with the reference's.
    """
    device = next(model.parameters()).device
    eos = getattr(tokenizer, "eos_token_id", None)
    per_task, per_sample = {}, {}
    prompts = {task: [tokenizer(s.prompt, add_special_tokens=False, return_tensors="pt")["input_ids"] for s in samples]
               for task, samples in samples_by_task.items()}
    engine = _full_cache_engine(model, make_cache, samples_by_task, prompts) if use_engine else None
    for task, samples in samples_by_task.items():
        rows = []
        for i, sample in enumerate(samples):
            ids = prompts[task][i].to(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            if engine is not None:
                out = engine_greedy_decode(engine, ids, sample.max_new_tokens, eos, keep_logits=keep_logits)
            else:
                out = greedy_decode(model, ids, sample.max_new_tokens, make_cache(), eos, keep_logits=keep_logits)
            peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
            text = tokenizer.decode(out["tokens"][0], skip_special_tokens=True)
            exact, partial = score(text, sample.answers)
            row = {"exact": exact, "partial": partial, "prediction": text, "prompt_tokens": ids.shape[1],
                   "new_tokens": out["tokens"].shape[1], "prefill_s": out["prefill_s"], "decode_s": out["decode_s"],
                   "peak_gpu_bytes": peak, **cache_bytes(out["cache"])}
            stats = out["cache"].stats() if hasattr(out["cache"], "stats") else {}
            row["counters"] = {k: v for k, v in stats.items() if isinstance(v, int) and not k.endswith("bytes")}
            if keep_logits:
                row["tokens"], row["logits"] = out["tokens"], out["logits"]
            if reference is not None:
                ref = reference[task][i]
                forced = greedy_decode(model, ids, 0, make_cache(), forced_tokens=ref["tokens"].to(device), keep_logits=True)
                row.update(next_token_fidelity(ref["logits"], forced["logits"]))
            rows.append(row)
        per_sample[task] = rows
        per_task[task] = _aggregate(rows)
    return {"tasks": per_task, "per_sample": per_sample, "overall": _aggregate([r for rs in per_sample.values() for r in rs])}


def _aggregate(rows: list[dict]) -> dict[str, Any]:
    if not rows:
        return {}
    n = len(rows)
    decode_s = sum(r["decode_s"] for r in rows)
    new_tokens = sum(max(r["new_tokens"] - 1, 0) for r in rows)  # the first token comes from prefill
    agg = {
        "samples": n,
        "accuracy": 100.0 * sum(r["exact"] for r in rows) / n,
        "partial": 100.0 * sum(r["partial"] for r in rows) / n,
        "tokens_per_s": new_tokens / decode_s if decode_s > 0 else float("nan"),
        "prefill_s": sum(r["prefill_s"] for r in rows) / n,
        "kv_device_bytes": max(r["device_bytes"] for r in rows),
        "kv_host_bytes": max(r["host_bytes"] for r in rows),
        "kv_full_bytes": max(r["full_bytes"] for r in rows),
        "compression_ratio": sum(r["full_bytes"] for r in rows) / max(1, sum(r["device_bytes"] for r in rows)),
        "peak_gpu_bytes": max((r["peak_gpu_bytes"] or 0) for r in rows) if rows[0]["peak_gpu_bytes"] is not None else None,
    }
    counters: dict[str, int] = {}
    for r in rows:
        for k, v in r["counters"].items():
            counters[k] = counters.get(k, 0) + v
    agg["counters"] = counters
    for key in ("kl", "top1_agreement"):
        if key in rows[0]:
            agg[key] = sum(r[key] for r in rows) / n
    return agg


def format_table(results: dict[str, Any]) -> str:
    """A per-task text table of one :func:`neutrain.eval.evaluate` result."""
    cols = ["task", "n", "acc", "partial", "tok/s", "KV dev MiB", "KV host MiB", "ratio"]
    has_fid = any("kl" in r for r in results["tasks"].values())
    if has_fid:
        cols += ["KL", "top1"]
    lines = [f"kv={results['kv']}", " | ".join(cols)]
    for task, r in {**results["tasks"], "overall": results["overall"]}.items():
        cells = [task, str(r["samples"]), f"{r['accuracy']:.1f}", f"{r['partial']:.1f}", f"{r['tokens_per_s']:.1f}",
                 f"{r['kv_device_bytes'] / 2**20:.2f}", f"{r['kv_host_bytes'] / 2**20:.2f}", f"{r['compression_ratio']:.2f}"]
        if has_fid:
            cells += [f"{r.get('kl', float('nan')):.4f}", f"{r.get('top1_agreement', float('nan')):.3f}"]
        lines.append(" | ".join(cells))
    if results.get("perplexity_loss") is not None:
        lines.append(perplexity_text(results["perplexity_loss"]))
    return "\n".join(lines)


def write_json(results: dict[str, Any], path: str | Path) -> Path:
    """Write ``results`` (without tensors) as JSON; returns the path."""
    def clean(obj):
        if isinstance(obj, dict):
            return {k: clean(v) for k, v in obj.items() if not isinstance(v, torch.Tensor)}
        if isinstance(obj, list):
            return [clean(v) for v in obj]
        return obj

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean(results), indent=2, default=str))
    return path
