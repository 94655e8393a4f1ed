"""Decode half of ``benchmarks/decode/speculative.py``: every method on the same held-out prompts, one row each.

Methods (batch 1, ``new_tokens`` new tokens after each prompt, the first prompt run once more as a
warm-up that is not counted):

* ``engine_autoregressive``: :class:`~neutrain.decode.engine.DecodeEngine` (static cache, CUDA graph);
  the baseline of ``spec_over_ar_*``;
* ``neutrain_<scheme>``: :func:`neutrain.speculative.generate` with ``engine=True`` -- ``sd`` (K = 1),
  ``greedy_tree`` (T = 0), ``specinfer``, ``spectr``, ``importance`` (T = 1), K = 2 and 4;
* ``hf_assisted``: ``target.generate(assistant_model=draft)``;
* ``hf_static_compile``: ``target.generate(cache_implementation="static")`` with the decode forward
  compiled by ``torch.compile`` (CUDA only; each mode tried is recorded, a failure is a row with the error).

Each row has tokens/s as the median over prompts of new tokens / synchronized wall time of the
whole ``generate`` call, plus block efficiency (tokens per target call) and acceptance for neutrain's
schemes, and at T = 0 how many tokens agree with the engine's greedy decode.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Callable

import torch

from neutrain.speculative import generate
from neutrain.decode.engine import DecodeEngine

#: The serving targets by their fixed names and goals, shared by speculative.py (all five: it runs
#: engine_decode.py for the first two), engine_decode.py (the first two) and speculative_rounds.py.
GOALS = {"ar_roofline_fraction_8b": ">= 0.80", "neuzip_lossless_over_bf16_decode": ">= 1.0",
         "spec_over_ar_T0": ">= 2.0", "spec_over_ar_T1": ">= 1.6", "alpha_gain_points_T1": ">= 10"}
#: The engine's own two (engine_decode.json).
ENGINE_TARGETS = ("ar_roofline_fraction_8b", "neuzip_lossless_over_bf16_decode")
#: Goals a committed record may still carry because it was measured before the goal changed.
SUPERSEDED_GOALS = {"ar_roofline_fraction_8b": {">= 0.6", ">= 0.75"},
                    "neuzip_lossless_over_bf16_decode": {">= 0.5 (stretch >= 0.9)", ">= 0.8"}}
#: Targets an older record names that the serving targets no longer hold; speculative.py still reports
#: both values, as ratios beside the targets.
RETIRED_TARGETS = {"spec_over_hf_assisted_T1": ">= 2.5", "k4_block_eff_over_sd_T1": ">= 1.15"}

STAT_KEYS = ("target_calls", "draft_calls", "committed_tokens", "verified_positions", "accepted_positions")


def log(*args):
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


class Clock:
    """Seconds left of the run's budget."""

    def __init__(self, budget_s: float):
        self.start, self.budget = time.time(), budget_s

    def left(self) -> float:
        return self.budget - (time.time() - self.start)

    def elapsed(self) -> float:
        return time.time() - self.start


def timed(device, fn):
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def measure(name: str, temperature: float, k: int | None, run: Callable, prompts: list[torch.Tensor], device,
            reference: dict | None = None) -> dict:
    """One row: ``run(prompt) -> (sequence [n + new], stats or None)`` on every prompt after a warm-up."""
    rates, secs, stats, agree, total_new = [], [], dict.fromkeys(STAT_KEYS, 0), [], 0
    for i, prompt in enumerate([prompts[0]] + prompts):
        (seq, st), sec = timed(device, lambda: run(prompt))
        if i == 0:
            continue
        new = seq.numel() - prompt.shape[1]
        rates.append(new / sec)
        secs.append(sec)
        total_new += new
        if st is not None:
            for key in STAT_KEYS:
                stats[key] += getattr(st, key)
        if reference is not None and temperature == 0:
            if i in reference:
                ref = reference[i]
                same = (seq[prompt.shape[1]:].cpu() == ref[prompt.shape[1]:]).long().cumprod(0).sum()
                agree.append((int(same), ref.numel() - prompt.shape[1]))
            else:
                reference[i] = seq.cpu()
    row = {"method": name, "temperature": temperature, "num_drafts": k, "tokens_per_s": statistics.median(rates),
           "tokens_per_s_per_prompt": rates, "seconds_per_prompt": secs, "new_tokens": total_new}
    if stats["target_calls"]:
        row.update(stats)
        row["block_efficiency"] = stats["committed_tokens"] / stats["target_calls"]
        row["acceptance"] = stats["accepted_positions"] / max(stats["verified_positions"], 1)
        row["ms_per_round"] = 1e3 * sum(secs) / stats["target_calls"]
    if agree:
        row["greedy_tokens_equal_to_engine_ar"] = f"{sum(a for a, _ in agree)}/{sum(n for _, n in agree)}"
    log({k: v for k, v in row.items() if not k.endswith("per_prompt")})
    return row


def hf_kwargs(new: int, temperature: float) -> dict:
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=temperature > 0)
    if temperature > 0:
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
    return kwargs


def hf_static_compile(target, prompts, new: int, device, clock: Clock, min_left_s: float) -> list[dict]:
    """HF ``generate`` with a static cache and the one-token forward compiled; rows for T = 0 and 1 or the errors.

    transformers 5.17 with ``mode="reduce-overhead"`` failed with "accessing tensor output of CUDAGraphs that
    has been overwritten": here each call marks a new CUDA-graph step and clones the logits it returns;
    if that still fails, ``mode="default"`` (no CUDA graphs) is tried. The prefill runs eagerly, as in
    transformers' own auto-compile.
    """
    from transformers import GenerationConfig

    if device.type != "cuda":
        return [{"method": "hf_static_compile", "skipped": "needs CUDA"}]
    extra = {"disable_compile": True} if hasattr(GenerationConfig(), "disable_compile") else {}
    attempts: dict[str, str] = {}
    for mode in ("reduce-overhead", "default"):
        if clock.left() < min_left_s:
            attempts[mode] = "skipped: time budget"
            break
        eager = target.forward
        compiled = torch.compile(eager, mode=mode, fullgraph=True, dynamic=False)

        @functools.wraps(eager)  # generate reads the forward's signature (logits_to_keep, cache_position)
        def forward(*args, _compiled=compiled, _graphs=mode == "reduce-overhead", **kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None or ids.shape[1] != 1:
                return eager(*args, **kwargs)
            if _graphs:
                torch.compiler.cudagraph_mark_step_begin()
            out = _compiled(*args, **kwargs)
            if _graphs:
                out.logits = out.logits.clone()  # the next replay overwrites the graph's output buffer
            return out

        target.forward = forward
        started = time.time()
        try:
            rows = []
            for temperature in (0.0, 1.0):
                rows.append(measure("hf_static_compile", temperature, None, lambda p, t=temperature: (target.generate(
                    p, cache_implementation="static", **extra, **hf_kwargs(new, t))[0], None), prompts, device))
                rows[-1].update(compile_mode=mode, attempts=dict(attempts), first_call_includes_compile_s=time.time() - started)
            return rows
        except Exception as exc:  # record it; the benchmark goes on
            attempts[mode] = f"{type(exc).__name__}: {exc}"[:500]
            log(f"hf_static_compile mode={mode} failed: {attempts[mode]}")
        finally:
            del target.forward  # back to the class's forward
            torch._dynamo.reset()
    return [{"method": "hf_static_compile", "error": attempts}]


def decode_benchmarks(target, draft, prompts, args, device, clock: Clock) -> list[dict]:
    """Every method's row, in priority order; rows left when the time is spent say so."""
    n, new = prompts[0].shape[1], args.new_tokens
    rows: list[dict] = []
    reference: dict[int, torch.Tensor] = {}
    gen = torch.Generator(device=device).manual_seed(0)
    engine = DecodeEngine(target, max_len=n + new, seed=0)

    def engine_ar(temperature):
        return lambda p: (engine.generate(p.to(device), new, temperature=temperature)[0], None)

    def speculative(scheme, k, temperature):
        def run(p):
            out = generate(target, draft, p.to(device), num_drafts=k, draft_len=args.draft_len,
                           scheme="specinfer" if scheme == "greedy_tree" else scheme, temperature=temperature,
                           max_new_tokens=new, engine=True, generator=gen)
            return out.sequences[0], out.stats
        return run

    def assisted(temperature):
        return lambda p: (target.generate(p.to(device), assistant_model=draft, **hf_kwargs(new, temperature))[0], None)

    # Priority order: what the decode targets need first (HF assisted at T = 0 and HF's compiled static
    # cache are context, run while time is left).
    plan = [("engine_autoregressive", t, None, engine_ar(t)) for t in (0.0, 1.0)]
    for temperature in (0.0, 1.0):
        plan.append(("neutrain_sd", temperature, 1, speculative("sd", 1, temperature)))
        for k in (2, 4):
            for scheme in (["greedy_tree"] if temperature == 0 else ["specinfer", "spectr", "importance"]):
                plan.append((f"neutrain_{scheme}", temperature, k, speculative(scheme, k, temperature)))
    plan.append(("hf_assisted", 1.0, None, assisted(1.0)))
    run_plan(plan, rows, prompts, device, clock, args, reference)  # T = 0 AR first: the greedy reference
    if args.hf_static:
        rows += hf_static_compile(target, prompts, new, device, clock, args.reserve_s + args.compile_reserve_s)
    run_plan([("hf_assisted", 0.0, None, assisted(0.0))], rows, prompts, device, clock, args, reference)
    return rows


def run_plan(plan, rows: list[dict], prompts, device, clock: Clock, args, reference: dict) -> None:
    for name, temperature, k, run in plan:
        if clock.left() < args.reserve_s:
            rows.append({"method": name, "temperature": temperature, "num_drafts": k, "skipped": "time budget"})
            continue
        try:
            rows.append(measure(name, temperature, k, run, prompts, device, reference))
        except Exception as exc:  # one broken method must not lose the others
            rows.append({"method": name, "temperature": temperature, "num_drafts": k,
                         "error": f"{type(exc).__name__}: {exc}"[:500]})
            log(rows[-1])


def round_split(best: dict, rows: list[dict], draft, prompt: torch.Tensor, args, device) -> dict:
    """Per-round time of ``best``, split with separately measured pieces (all with CUDA graphs):

    draft = ``draft_len`` steps of the draft's engine at K rows; verify ~ one step of the target's
    engine (a lower bound: the tree holds ``K * draft_len + 1`` tokens); the rest (acceptance, host
    and cache surgery) = the measured round time minus both.
    """
    k = best.get("num_drafts") or 1
    ar = next(r for r in rows if r["method"] == "engine_autoregressive" and r["temperature"] == best["temperature"])
    drafter = DecodeEngine(draft, max_len=prompt.shape[1] + args.new_tokens, batch=k, seed=1)
    run = lambda: drafter.generate(prompt.to(device).expand(k, -1), args.new_tokens, temperature=best["temperature"])  # noqa: E731
    run()
    secs = statistics.median(timed(device, run)[1] for _ in range(3))
    draft_step_ms = 1e3 * secs / args.new_tokens
    target_step_ms = 1e3 / ar["tokens_per_s"]
    draft_ms, verify_ms = args.draft_len * draft_step_ms, target_step_ms
    return {"method": f"{best['method']}_K{k}_T{best['temperature']:g}", "round_ms": best["ms_per_round"],
            "draft_ms": draft_ms, "verify_ms_lower_bound": verify_ms,
            "accept_host_surgery_ms": best["ms_per_round"] - draft_ms - verify_ms,
            "draft_step_ms_at_K_rows": draft_step_ms, "target_step_ms": target_step_ms,
            "how": "draft and verify from the engines' AR steps (CUDA graphs on a GPU) measured apart; the rest by subtraction"}
