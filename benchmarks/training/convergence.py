"""Loss curves of AdamW, LOMO and AdaLomo, dense and NeuZip-compressed, on the same data and tokens.

Each optimizer is swept over a few learning rates (fused SGD wants a far larger rate
than AdamW), with everything else fixed: the same small Llama from random init, the
same Python-stdlib corpus, tokenizer and token budget, the same seed. The
learning-rate guidance of ``docs/memory.md`` comes from this file's results. The model dtype is ``auto``,
the default recipe's CPU setting: dense runs keep fp32 weights; compressed runs store
bf16 NeuZip weights (stochastic rounding on) and compute in fp32. Runs on CPU (no GPU needed):

    python benchmarks/training/convergence.py                 # writes benchmarks/training/results.jsonl#convergence
    python benchmarks/training/convergence.py --steps 40      # quicker
    python benchmarks/training/convergence.py --only adalomo:neuzip-lossless --merge   # re-run one sweep, keep the rest
    python benchmarks/training/convergence.py --only lomo:dense --lrs 1.0 --merge      # add one rate
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("DISABLE_TQDM", "1")

BASE = {
    "model": {"init": "random", "tokenizer": "train-bpe", "tokenizer_vocab_size": 2048, "dtype": "auto",
              "config": {"model_type": "llama", "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4,
                         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 512,
                         "tie_word_embeddings": False}},
    "data": {"datasets": [{"path": "python-stdlib", "type": "text", "max_files": 120}], "sequence_len": 128, "sample_packing": True},
    "train": {"micro_batch_size": 8, "lr_scheduler": "cosine", "warmup_steps": 5, "logging_steps": 5, "save_steps": 100000,
              "max_grad_norm": 1.0, "seed": 7, "use_cpu": True},
    "memory": {"stochastic_rounding": True, "clip_mode": "per_tensor"},
    "eval": {"perplexity": True, "max_eval_samples": 48},
    "export": {"format": "none"},
}
SWEEP = {
    ("adamw", "dense"): [3e-4, 1e-3, 3e-3, 1e-2],
    ("lomo", "dense"): [3e-2, 1e-1, 3e-1, 1.0],
    # AdaLomo scales its step by each tensor's RMS (~0.02 for matrices at init): rates ~50x AdamW's.
    ("adalomo", "dense"): [3e-3, 1e-2, 3e-2, 1e-1, 3e-1],
    # Compressed runs hold bf16 weights (dense ones fp32 here): two rates each show where they land.
    ("lomo", "neuzip-lossless"): [1e-1, 3e-1],
    ("adalomo", "neuzip-lossless"): [3e-2, 1e-1],
}


def run_one(optimizer: str, weights: str, lr: float, steps: int, workdir: str) -> dict:
    from neutrain.config import validate_recipe
    from neutrain.cli.train import build_trainer

    raw = copy.deepcopy(BASE)
    out = os.path.join(workdir, f"{optimizer}-{weights}-{lr:g}")
    raw["train"].update(optimizer=optimizer, learning_rate=lr, max_steps=steps, output_dir=out)
    raw["memory"]["weights"] = weights
    shared = os.path.join(workdir, "tokenizer")
    if os.path.isdir(shared):  # one tokenizer for every run (a run reuses <output_dir>/tokenizer)
        shutil.copytree(shared, os.path.join(out, "tokenizer"))
    ctx = build_trainer(validate_recipe(raw))
    if not os.path.isdir(shared):
        shutil.copytree(os.path.join(out, "tokenizer"), shared)
    t = time.perf_counter()
    ctx.trainer.train()
    curve = [(h["step"], h["loss"]) for h in ctx.trainer.state.log_history if "loss" in h]
    held = ctx.trainer.evaluate()["eval_loss"]
    return {"optimizer": optimizer, "weights": weights, "lr": lr, "curve": curve, "heldout_loss": held,
            "heldout_ppl": math.exp(min(held, 50)), "seconds": time.perf_counter() - t}


def _merged(runs: list[dict], steps: int) -> list[dict]:
    """``runs`` plus the earlier runs (same step count) of the current record that ``runs`` did not redo."""
    from benchmarks._common import read_record

    old = read_record("convergence")
    if old is None:
        return runs
    if old["settings"]["steps"] != steps:
        raise SystemExit(f"--merge: the current convergence record holds {old['settings']['steps']}-step runs, not {steps}")
    redone = {(r["optimizer"], r["weights"], r["lr"]) for r in runs}
    kept = [r for r in old["results"]["runs"] if (r["optimizer"], r["weights"], r["lr"]) not in redone]
    order = {key: i for i, key in enumerate(SWEEP)}
    return sorted(kept + runs, key=lambda r: (order.get((r["optimizer"], r["weights"]), len(order)), r["lr"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--only", help="comma-separated optimizer:weights pairs, e.g. lomo:dense")
    ap.add_argument("--lrs", help="comma-separated rates to run from the selected sweeps (default: all)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the runs of other sweeps from an existing results file with the same --steps")
    args = ap.parse_args()
    from benchmarks._common import git_provenance

    git_provenance()  # fail now, not after the measurement, if the commit cannot be recorded
    keys = list(SWEEP)
    if args.only:
        keys = [tuple(k.split(":")) for k in args.only.split(",")]
    runs = []
    with tempfile.TemporaryDirectory() as work:
        for key in keys:
            for lr in SWEEP[key]:
                if args.lrs and lr not in {float(x) for x in args.lrs.split(",")}:
                    continue
                r = run_one(key[0], key[1], lr, args.steps, work)
                runs.append(r)
                print(f"{r['optimizer']:>8} {r['weights']:>16} lr={lr:<7g} held-out loss {r['heldout_loss']:.3f} "
                      f"final train loss {r['curve'][-1][1]:.3f} ({r['seconds']:.0f} s)", flush=True)
    if args.merge:
        runs = _merged(runs, args.steps)
    best = {}
    for r in runs:
        k = f"{r['optimizer']}/{r['weights']}"
        if k not in best or r["heldout_loss"] < best[k]["heldout_loss"]:
            best[k] = r
    headline = "; ".join(f"{k} best lr {v['lr']:g}: held-out loss {v['heldout_loss']:.2f}" for k, v in best.items())
    from benchmarks._common import write_result

    tokens = args.steps * BASE["train"]["micro_batch_size"] * BASE["data"]["sequence_len"]
    write_result("convergence", {"steps": args.steps, "tokens": tokens, "model": BASE["model"]["config"], "sweep": {f"{a}/{b}": v for (a, b), v in SWEEP.items()}},
                 {"runs": runs, "best": {k: {"lr": v["lr"], "heldout_loss": v["heldout_loss"]} for k, v in best.items()}, "headline": headline})
    print(headline)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
