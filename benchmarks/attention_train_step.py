"""One training step of the Llama-3-8B architecture (NeuZip lossless + fused LOMO, activation
checkpointing, batch 1) with SageAttention against cuDNN SDPA, at several sequence lengths.

Each variant runs in a fresh subprocess (clean allocator). The attention variants go through
the same registered function ``neutrain_sage``, with the dispatch forced:

    sage   NEUTRAIN_SAGE_DISPATCH=always (+ NEUTRAIN_SAGE_BACKWARD, the backward route, and
           NEUTRAIN_SAGE_KERNEL, the forward kernel: triton, or gluon on Hopper)
    cudnn  NEUTRAIN_SAGE_DISPATCH=never: torch SDPA with cuDNN first, no mask tensor
    sdpa   transformers' own "sdpa" (what a recipe without neutrain_sage gets)

    python benchmarks/attention_train_step.py --seqs 8192,16384 --variants sage,cudnn --kernel gluon --out step.json

The record is written after every variant, so a run cut off by its timeout keeps the finished ones.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _train_peers import device_used_gib  # noqa: E402
from train_memory import LLAMA3_8B, TINY  # noqa: E402


def run_child(variant: str, seqs: list[int], steps: int, tiny: bool) -> dict:
    import torch
    from transformers import LlamaConfig

    from neutrain.attention import counters, register, reset_counters
    from neutrain.nn import causal_lm_loss
    from neutrain.nn.load import init_compressed
    from neutrain.optim import OPTIMIZERS

    config = LlamaConfig(**(TINY if tiny else LLAMA3_8B))
    config.max_position_embeddings = max(seqs)
    config._attn_implementation = "sdpa" if variant == "sdpa" else register()
    t0 = time.perf_counter()
    model, _ = init_compressed(config, "neuzip-lossless", "cuda", dtype=torch.bfloat16, progress=False)
    build_s = time.perf_counter() - t0
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    opt = OPTIMIZERS["lomo"](model.parameters(), lr=1e-5, clip_mode="per_tensor", max_grad_norm=1.0).bind(model)
    result = {"variant": variant, "build_s": round(build_s, 1), "backward_route": os.environ.get("NEUTRAIN_SAGE_BACKWARD")}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for seq in seqs:
        ids = torch.randint(0, config.vocab_size, (1, seq), device="cuda", generator=gen)
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
                "step_s": med, "step_times_s": [round(t, 4) for t in times], "tokens_per_s": seq / med,
                "losses": losses, "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30, "device_used_gib": device_used_gib(),
                "counters": {k: v for k, v in counters.items()}}
        except torch.OutOfMemoryError as exc:
            result[str(seq)] = {"oom": True, "error": str(exc).splitlines()[0][:200]}
            torch.cuda.empty_cache()
    return result


def run(variants: list[str], seqs: list[int], steps: int, tiny: bool, backward: str, timeout: float,
        kernel: str = "triton", done=lambda rows: None) -> list[dict]:
    """Every variant in its own subprocess; a variant that fails or times out is recorded as such.
    ``done(rows)`` is called after each variant."""
    rows = []
    for variant in variants:
        env = dict(os.environ)
        env["NEUTRAIN_SAGE_DISPATCH"] = {"sage": "always", "cudnn": "never"}.get(variant, "table")
        env["NEUTRAIN_SAGE_BACKWARD"] = backward
        env["NEUTRAIN_SAGE_KERNEL"] = kernel
        cmd = [sys.executable, __file__, "--child", variant, "--seqs", ",".join(map(str, seqs)), "--steps", str(steps)]
        cmd += ["--tiny"] if tiny else []
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            row = json.loads(line[7:]) if line else {"variant": variant, "failed": True, "stderr": proc.stderr[-1500:]}
        except subprocess.TimeoutExpired:
            row = {"variant": variant, "failed": True, "timeout_s": timeout}
        row["wall_s"] = round(time.perf_counter() - t, 1)
        if variant == "sage":
            row["kernel"] = kernel
        print(json.dumps(row)[:800], flush=True)
        rows.append(row)
        done(rows)
    return rows


def speedups(rows: list[dict], seqs: list[int], base: str = "cudnn") -> dict:
    """{seq: baseline step time / sage step time} where both ran."""
    by = {r["variant"]: r for r in rows}
    out = {}
    for seq in seqs:
        s, b = by.get("sage", {}).get(str(seq), {}), by.get(base, {}).get(str(seq), {})
        if "step_s" in s and "step_s" in b:
            out[str(seq)] = b["step_s"] / s["step_s"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="sage,cudnn")
    ap.add_argument("--seqs", default="8192,16384")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--backward", default="cudnn", help="sage's backward route (triton, cudnn, flash)")
    ap.add_argument("--kernel", default="triton", choices=("triton", "gluon"), help="sage's forward kernel")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    if args.child:
        print("RESULT " + json.dumps(run_child(args.child, seqs, args.steps, args.tiny)))
        return 0

    def write(rows):
        if args.out:
            Path(args.out).write_text(json.dumps({"rows": rows, "speedup_vs_cudnn": speedups(rows, seqs)}, indent=2))

    run(args.variants.split(","), seqs, args.steps, args.tiny, args.backward, args.timeout, args.kernel, write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
