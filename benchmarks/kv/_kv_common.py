"""What the KV-cache benchmark's parts share: the run's time budget, the cache settings they evaluate,
one setting's evaluation, the merge plan's threshold and the diagnosis of a model's caches.

``benchmarks/kv/kv_eval.py`` is the command; the parts are ``_kv_fidelity`` (the trained retrieval model),
``_kv_throughput`` (decode tokens/s on Llama-3-8B shapes) and ``_kv_real`` (SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import time

from neutrain.eval.loop import format_table, kv_cache_factory, run_tasks
from neutrain.eval.tasks import generate_task


class Deadline:
    """The run's internal time budget: sections check ``left()`` and record what they skipped, so that the
    single device call ends inside its limit with every number measured so far written.

    One object for the whole run (:data:`DEADLINE`), which every part imports; the command starts it.
    """

    def __init__(self, seconds: float | None):
        self.start(seconds)

    def start(self, seconds: float | None) -> None:
        self.begun = time.time()
        self.end = self.begun + seconds if seconds else None

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.time()

    def elapsed(self) -> float:
        return time.time() - self.begun


DEADLINE = Deadline(None)

# The comparison at matched KV memory: kvpress keeps a quarter of the prompt (4x, between
# MiniCache + 4-bit's ~4x and ShadowKV's ~4.8x device ratio); QuantizedCache stores 4-bit groups.
PRESS_RATIO = 0.75


def baseline_configs() -> dict[str, tuple[str, dict]]:
    """transformers' QuantizedCache and kvpress presses (optional packages; recorded as unavailable without them),
    each by its registered cache name."""
    return {
        "quantized_cache_4bit": ("quantized", dict(nbits=4, group=64, residual=128)),
        "kvpress_snapkv": ("kvpress:snapkv", dict(compression_ratio=PRESS_RATIO)),
        "kvpress_streamingllm": ("kvpress:streamingllm", dict(compression_ratio=PRESS_RATIO)),
        "kvpress_expected_attention": ("kvpress:expected_attention", dict(compression_ratio=PRESS_RATIO)),
    }


def evaluate_config(model, tok, samples, kind: str, options: dict, reference=None):
    """``run_tasks`` for one cache setting (``kind``: a registered cache, neutrain.eval.kv.registry). A baseline
    whose package is missing, or any failure, is returned as ``{"unavailable": reason}`` / ``{"error": ...}``
    instead of raised: one setting must not end the run."""
    from neutrain.eval.kv.baselines import BaselineUnavailable

    try:
        with kv_cache_factory(model, kind, **options) as make:
            return run_tasks(model, tok, samples, make, reference=reference)
    except BaselineUnavailable as exc:
        return {"unavailable": str(exc)}
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON; the other settings still run
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def summarise(res, label, options):
    out = {"kv": label, "options": options, "tasks": res["tasks"], "overall": res["overall"]}
    out["table"] = format_table(out)
    return out



def shadowkv_paper_options(model, ctx: int, budget: float = 0.0156) -> dict:
    """The paper's ShadowKV settings scaled to ``model`` and a ``ctx``-token prompt.

    Rank 160 of a 1,024-wide key (8 KV heads x 128) is scaled to this model's key width; 48 outlier
    chunks at 128K scaled to ``ctx`` (at least 2); sparse from half the context up, so every prompt is.
    """
    cfg = model.config
    width = cfg.num_key_value_heads * getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    return dict(budget=budget, rank=max(8, round(160 / 1024 * width)), outliers=max(2, round(48 * ctx / 131072)),
                min_prefill=ctx // 2)


def real_configs(model, ctx: int, min_similarity: float) -> dict[str, tuple[str, dict]]:
    """Every cache setting of the real-model run: the methods, each piece alone, and the fixes.

    "Alone" means the other pieces are off: ShadowKV's low-rank keys with every chunk selected and
    values on the device; its sparse selection with exact keys; its value offload with exact keys and
    every chunk. MiniCache's merge without retention (gamma 0), merge with retention (gamma 0.05:
    the method), and the 4-bit store on unmerged layers.
    """
    paper = shadowkv_paper_options(model, ctx)
    every_chunk = 10**9  # a token budget above any prompt: every chunk selected
    layers = model.config.num_hidden_layers
    return {
        "minicache_merge": ("minicache", dict(gamma=0.05, t=0.6)),
        "minicache_merge_4bit": ("minicache", dict(gamma=0.05, t=0.6, quant_bits=4, quant_group=64)),
        "shadowkv_paper_scaled": ("shadowkv", paper),
        # the same in the paper's chunks of 8 whatever the budget (before min_selected_chunks: 2 chunks at 1K)
        "shadowkv_paper_literal": ("shadowkv", {**paper, "min_selected_chunks": 0}),
        "shadowkv_budget_6pct": ("shadowkv", {**paper, "budget": 0.0625}),
        "shadowkv_budget_12pct": ("shadowkv", {**paper, "budget": 0.125}),
        # the paper's budget in finer chunks: twice the landmarks, each the mean of 4 keys instead of 8
        # (chunk sizes as named: min_selected_chunks off)
        "shadowkv_paper_chunk4": ("shadowkv", {**paper, "chunk_size": 4, "outliers": 2 * paper["outliers"],
                                               "min_selected_chunks": 0}),
        "shadowkv_paper_chunk2": ("shadowkv", {**paper, "chunk_size": 2, "outliers": 4 * paper["outliers"],
                                               "min_selected_chunks": 0}),
        "shadowkv_budget_6pct_chunk4": ("shadowkv", {**paper, "budget": 0.0625, "chunk_size": 4,
                                                     "outliers": 2 * paper["outliers"], "min_selected_chunks": 0}),
        # each piece alone
        "shadowkv_lowrank_keys_only": ("shadowkv", {**paper, "budget": every_chunk, "offload_values": False}),
        "shadowkv_sparse_selection_only": ("shadowkv", {**paper, "exact_keys": True, "offload_values": False}),
        "shadowkv_offloaded_values_only": ("shadowkv", {**paper, "budget": every_chunk, "exact_keys": True}),
        "minicache_merge_only_gamma0": ("minicache", dict(gamma=0.0, t=0.6)),
        "minicache_4bit_only": ("minicache", dict(start_layer=layers, quant_bits=4, quant_group=64)),
        # the fix the diagnosis points to: merge only the pairs that are similar
        "minicache_merge_similar_pairs": ("minicache", dict(gamma=0.05, t=0.6, min_similarity=min_similarity)),
        "minicache_merge_similar_pairs_4bit": ("minicache", dict(gamma=0.05, t=0.6, min_similarity=min_similarity,
                                                                 quant_bits=4, quant_group=64)),
    }


def chosen_min_similarity(model, tok, task: str, length: int, args, log) -> tuple[float, dict | None]:
    """``--min-similarity`` when given as a number; with ``auto`` (the default) the threshold the merge plan
    finds for this model (neutrain/eval/kv/diagnose.py::merge_plan) on 2 calibration prompts of ``task``
    (seed 7: not the evaluated prompts, seed 42). Returns the threshold and the plan (None when given)."""
    from neutrain.eval.kv.diagnose import model_merge_plan

    if args.min_similarity != "auto":
        return float(args.min_similarity), None
    device = next(model.parameters()).device
    prompts = [tok(s.prompt, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
               for s in generate_task(task, tok, length, 2, seed=7)]
    plan = model_merge_plan(model, prompts)
    log(f"merge plan: min_similarity {plan['min_similarity']}, merged pairs {plan['merged_pairs']} of "
        f"{[p['layers'] for p in plan['pairs']]} (similarity {[p['similarity'] for p in plan['pairs']]}, "
        f"restore error {[p['restore_error'] for p in plan['pairs']]})")
    return plan["min_similarity"], plan


def diagnose_model(model, tok, samples, ctx: int, log, ranks=(8, 16, 32, 64)) -> dict:
    """Key spectrum, adjacent-layer cosines and ShadowKV's needle recall, averaged over ``samples``."""
    from neutrain.eval.kv.diagnose import (adjacent_layer_cosine, key_spectrum, needle_chunk_recall,
                                           needle_token_positions, prefill_states)
    from neutrain.eval.loop import greedy_decode

    device = next(model.parameters()).device
    spectra, cos_k, cos_v = [], [], []
    recall = {"paper": [], "6pct": []}
    for sample in samples:
        ids = tok(sample.prompt, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
        states = prefill_states(model, ids)
        spectra.append(key_spectrum(states["pre_rope_keys"], ranks))
        cos_k.append(adjacent_layer_cosine(states["keys"]))
        cos_v.append(adjacent_layer_cosine(states["values"]))
        del states
        needle = needle_token_positions(tok, sample.prompt, sample.answers[0])
        for name, budget in (("paper", 0.0156), ("6pct", 0.0625)):
            options = {**shadowkv_paper_options(model, ctx, budget), "log_selection": True}
            with kv_cache_factory(model, "shadowkv", **options) as make:
                out = greedy_decode(model, ids, sample.max_new_tokens, make(), getattr(tok, "eos_token_id", None))
            recall[name].append(needle_chunk_recall(out["cache"], needle))

    def mean(rows):  # rows: [sample][layer] -> [layer]
        return [round(sum(r[i] for r in rows) / len(rows), 4) for i in range(len(rows[0]))]

    def nanmean_layers(items, key):
        cols = list(zip(*[it[key] for it in items]))
        return [round(sum(x for x in c if x == x) / max(1, sum(1 for x in c if x == x)), 4) if any(x == x for x in c)
                else None for c in cols]

    spectrum = {r: mean([[layer[r] for layer in s] for s in spectra]) for r in ranks}
    out = {
        "samples": len(samples),
        "key_energy_at_rank": {str(r): v for r, v in spectrum.items()},
        "key_energy_at_rank_mean": {str(r): round(sum(v) / len(v), 4) for r, v in spectrum.items()},
        "adjacent_cosine_keys": mean(cos_k), "adjacent_cosine_values": mean(cos_v),
        "needle_recall": {name: {"selected_per_layer": nanmean_layers(rows, "selected"),
                                 "covered_per_layer": nanmean_layers(rows, "covered")} for name, rows in recall.items()},
    }
    for name, rows in recall.items():
        vals = [x for x in out["needle_recall"][name]["covered_per_layer"] if x is not None]
        out["needle_recall"][name]["covered_mean"] = round(sum(vals) / len(vals), 4) if vals else None
    log(f"key energy (mean over layers): {out['key_energy_at_rank_mean']}")
    log(f"adjacent cosine keys: {out['adjacent_cosine_keys']}\nadjacent cosine values: {out['adjacent_cosine_values']}")
    log(f"needle recall covered (mean): paper {out['needle_recall']['paper']['covered_mean']}, "
        f"6.25% {out['needle_recall']['6pct']['covered_mean']}")
    return out

