"""Loss curves of AdamW, LOMO and AdaLomo, dense and NeuZip-compressed, on the same data and tokens.

Each optimizer is swept over a few learning rates (fused SGD wants a far larger rate
than AdamW), with everything else fixed: the same small Llama from random init, the
same Python-stdlib corpus and token budget, the same seed. The README's learning-rate
guidance comes from this file's results. Runs on CPU in minutes (no GPU needed):

    python benchmarks/convergence.py                 # writes benchmarks/results/convergence.json
    python benchmarks/convergence.py --steps 40      # quicker
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("DISABLE_TQDM", "1")

BASE = {
    "model": {"init": "random", "tokenizer": "train-bpe", "tokenizer_vocab_size": 2048, "dtype": "bfloat16",
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
    ("adamw", "dense"): [3e-4, 1e-3, 3e-3],
    ("lomo", "dense"): [3e-2, 1e-1, 3e-1],
    # Compressed + fused runs are bit-identical to dense + fused with rounding off (tests/unit/nn/test_parity.py);
    # one rate each confirms it with stochastic rounding on, at a fraction of the CPU time.
    ("lomo", "neuzip-lossless"): [1e-1],
    ("adalomo", "dense"): [1e-3, 3e-3, 1e-2],
    ("adalomo", "neuzip-lossless"): [3e-3],
}


def run_one(optimizer: str, weights: str, lr: float, steps: int, workdir: str) -> dict:
    from neutrain.config import validate_recipe
    from neutrain.run import build_trainer

    raw = copy.deepcopy(BASE)
    raw["train"].update(optimizer=optimizer, learning_rate=lr, max_steps=steps,
                        output_dir=os.path.join(workdir, f"{optimizer}-{weights}-{lr:g}"))
    raw["memory"]["weights"] = weights
    ctx = build_trainer(validate_recipe(raw))
    t = time.perf_counter()
    ctx.trainer.train()
    curve = [(h["step"], h["loss"]) for h in ctx.trainer.state.log_history if "loss" in h]
    held = ctx.trainer.evaluate()["eval_loss"]
    return {"optimizer": optimizer, "weights": weights, "lr": lr, "curve": curve, "heldout_loss": held,
            "heldout_ppl": math.exp(min(held, 50)), "seconds": time.perf_counter() - t}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--only", help="comma-separated optimizer:weights pairs, e.g. lomo:dense")
    args = ap.parse_args()
    keys = list(SWEEP)
    if args.only:
        keys = [tuple(k.split(":")) for k in args.only.split(",")]
    runs = []
    with tempfile.TemporaryDirectory() as work:
        for key in keys:
            for lr in SWEEP[key]:
                r = run_one(key[0], key[1], lr, args.steps, work)
                runs.append(r)
                print(f"{r['optimizer']:>8} {r['weights']:>16} lr={lr:<7g} held-out loss {r['heldout_loss']:.3f} "
                      f"final train loss {r['curve'][-1][1]:.3f} ({r['seconds']:.0f} s)", flush=True)
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
