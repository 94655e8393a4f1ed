"""One training step (NeuZip lossless + fused LOMO, activation checkpointing) with SageAttention
against cuDNN SDPA, at several sequence lengths, on the Llama-3-8B architecture at batch 1 (``--model 8b``)
or on the default recipe's model at its batch of 8 (``--model default``, ``recipes/default.yaml``).

Each variant runs in a fresh subprocess (clean allocator). The attention variants go through
the same registered function ``neutrain_sage``, with the dispatch forced:

    sage   NEUTRAIN_SAGE_DISPATCH=always (+ NEUTRAIN_SAGE_BACKWARD, the backward route, and
           NEUTRAIN_SAGE_KERNEL, the forward kernel: triton, or gluon on Hopper)
    cudnn  NEUTRAIN_SAGE_DISPATCH=never: the registered function's SDPA path, which is transformers' sdpa
           function (the variant's name is the records')
    sdpa   transformers' own "sdpa" (what a recipe without neutrain_sage gets)
    auto   NEUTRAIN_SAGE_DISPATCH=table: what a recipe with neutrain_sage gets (the committed dispatch table);
           its counters say which kernel each attention call ran. ``auto_over_sdpa`` is sdpa's step time over
           auto's: below 1, the table costs training time against plain SDPA.

    python benchmarks/attention/attention_train_step.py --seqs 8192,16384 --variants sage,cudnn --kernel gluon --out step.json
    python benchmarks/attention/attention_train_step.py --model default --seqs 256 --steps 40 --variants auto,sdpa --out d.json

The record is written after every variant, so a run cut off by its timeout keeps the finished ones.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from benchmarks.memory._train_peers import device_used_gib  # noqa: E402
from benchmarks.memory.train_memory import LLAMA3_8B, TINY  # noqa: E402


def default_recipe_model() -> tuple[dict, int]:
    """The default recipe's model config (its tokenizer's vocabulary) and micro batch, as its loader reads them."""
    from neutrain.config import load_recipe

    recipe = load_recipe("default")
    config = {k: v for k, v in recipe.model.config.items() if k != "model_type"}
    return {**config, "vocab_size": recipe.model.tokenizer_vocab_size}, recipe.train.micro_batch_size


def model_config(model: str) -> tuple[dict, int]:
    """(LlamaConfig keywords, batch) of ``--model``."""
    if model == "default":
        return default_recipe_model()
    return dict(TINY if model == "tiny" else LLAMA3_8B), 1


def run_child(variant: str, seqs: list[int], steps: int, model_name: str) -> dict:
    import torch
    from transformers import LlamaConfig

    from neutrain.attention import counters, register, reset_counters
    from neutrain.nn import causal_lm_loss
    from neutrain.nn.load import init_compressed
    from neutrain.optim import optimizer_spec

    keywords, batch = model_config(model_name)
    config = LlamaConfig(**keywords)
    config.max_position_embeddings = max(seqs)
    config._attn_implementation = "sdpa" if variant == "sdpa" else register()
    t0 = time.perf_counter()
    model, _ = init_compressed(config, "neuzip-lossless", "cuda", dtype=torch.bfloat16, progress=False)
    build_s = time.perf_counter() - t0
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    rule = optimizer_spec("lomo").resolve()
    opt = rule(model.parameters(), lr=1e-5, clip_mode="per_tensor", max_grad_norm=1.0).bind(model)
    result = {"variant": variant, "model": model_name, "batch": batch, "build_s": round(build_s, 1),
              "backward_route": os.environ.get("NEUTRAIN_SAGE_BACKWARD")}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for seq in seqs:
        ids = torch.randint(0, config.vocab_size, (batch, seq), device="cuda", generator=gen)
        try:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            reset_counters()
            times, losses = [], []
            for _ in range(steps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                loss = causal_lm_loss(model, ids, ids)
                opt.backward(loss)
                opt.step()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
                losses.append(float(loss))
            warm = times[2:] if len(times) > 3 else times[1:]
            med = sorted(warm)[len(warm) // 2]
            result[str(seq)] = {
                "step_s": med, "step_times_s": [round(t, 5) for t in times], "tokens_per_s": batch * seq / med,
                "losses": losses, "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30, "device_used_gib": device_used_gib(),
                "counters": {k: v for k, v in counters.items()}}
        except torch.OutOfMemoryError as exc:
            result[str(seq)] = {"oom": True, "error": str(exc).splitlines()[0][:200]}
            torch.cuda.empty_cache()
    return result


def run(variants: list[str], seqs: list[int], steps: int, model: str, backward: str, timeout: float,
        kernel: str = "triton", done=lambda rows: None, rounds: int = 1) -> list[dict]:
    """Every variant in its own subprocess, ``rounds`` times, the order reversed every other round (A B B A:
    a drift of the card over the run falls on both); a variant that fails or times out is recorded as such.
    ``done(rows)`` is called after each variant."""
    rows = []
    for round_ in range(rounds):
        for variant in variants if round_ % 2 == 0 else variants[::-1]:
            env = dict(os.environ)
            env["NEUTRAIN_SAGE_DISPATCH"] = {"sage": "always", "cudnn": "never"}.get(variant, "table")
            env["NEUTRAIN_SAGE_BACKWARD"] = backward
            env["NEUTRAIN_SAGE_KERNEL"] = kernel
            cmd = [sys.executable, __file__, "--child", variant, "--seqs", ",".join(map(str, seqs)), "--steps",
                   str(steps), "--model", model]
            t = time.perf_counter()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                row = json.loads(line[7:]) if line else {"variant": variant, "failed": True,
                                                         "stderr": proc.stderr[-1500:]}
            except subprocess.TimeoutExpired:
                row = {"variant": variant, "failed": True, "timeout_s": timeout}
            row["wall_s"] = round(time.perf_counter() - t, 1)
            row["round"] = round_
            if variant == "sage":
                row["kernel"] = kernel
            print(json.dumps(row)[:800], flush=True)
            rows.append(row)
            done(rows)
    return rows


def step_time(rows: list[dict], variant: str, seq: int) -> float | None:
    """The median over rounds of ``variant``'s median step at ``seq`` (``None`` where it never ran).

    Example:
        >>> rows = [{"variant": "auto", "256": {"step_s": 0.3}}, {"variant": "auto", "256": {"step_s": 0.1}}]
        >>> step_time(rows, "auto", 256), step_time(rows, "sdpa", 256)
        (0.2, None)
    """
    times = [r[str(seq)]["step_s"] for r in rows if r["variant"] == variant and "step_s" in r.get(str(seq), {})]
    return statistics.median(times) if times else None


def speedups(rows: list[dict], seqs: list[int], base: str = "cudnn", variant: str = "sage") -> dict:
    """{seq: baseline step time / ``variant``'s step time} where both ran (:func:`step_time` of each)."""
    out = {}
    for seq in seqs:
        s, b = step_time(rows, variant, seq), step_time(rows, base, seq)
        if s and b:
            out[str(seq)] = b / s
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="sage,cudnn")
    ap.add_argument("--seqs", default="8192,16384")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--backward", default="cudnn", help="sage's backward route (triton, cudnn, flash)")
    ap.add_argument("--kernel", default="triton", choices=("triton", "gluon"), help="sage's forward kernel")
    ap.add_argument("--model", choices=("8b", "default", "tiny"), default="8b",
                    help="8b: Llama-3-8B at batch 1; default: recipes/default.yaml's model at its micro batch")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--rounds", type=int, default=1, help="run the variants this many times, A B B A")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    if args.child:
        print("RESULT " + json.dumps(run_child(args.child, seqs, args.steps, args.model)))
        return 0

    def write(rows):
        if args.out:
            record = {"model": args.model, "rows": rows, "speedup_vs_cudnn": speedups(rows, seqs),
                      "auto_over_sdpa": speedups(rows, seqs, "sdpa", "auto")}
            Path(args.out).write_text(json.dumps(record, indent=2))

    run(args.variants.split(","), seqs, args.steps, args.model, args.backward, args.timeout, args.kernel, write,
        args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
