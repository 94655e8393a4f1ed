"""MiniCache settings on the real model on CPU: accuracy gap and measured compression, per setting.

Same evaluation as the benchmark's real-model part (``benchmarks/_kv_real.py``: niah_single, SmolLM2's own
tokenizer, no chat template, seed-42 samples, greedy), through the library's ``run_tasks``; one JSON line per
setting, so a long sweep can be read while it runs.

Usage:
    PYTHONPATH=. python benchmarks/diag/minicache_sweep.py --len 1024 --samples 10 \
        --setting '{"start_layer": 28}' --setting '{"gamma": 0.5}'
"""

from __future__ import annotations

import argparse
import json
import time

from neutrain.eval.loop import kv_cache_factory, run_tasks


def main():
    from neutrain.eval.real_model import load_smollm2
    from neutrain.eval.tasks import generate_task

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--len", type=int, default=1024)
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--setting", action="append", default=[], help="MiniCache options as JSON (t, gamma default 0.6, 0.05)")
    p.add_argument("--no-full", action="store_true")
    args = p.parse_args()
    model, tok = load_smollm2()
    samples = {"niah_single": generate_task("niah_single", tok, args.len, args.samples, seed=42)}
    if not args.no_full:
        start = time.time()
        with kv_cache_factory(model, "full") as make:
            res = run_tasks(model, tok, samples, make)
        print(json.dumps({"setting": "full", "accuracy": res["overall"]["accuracy"],
                          "seconds": round(time.time() - start, 1)}), flush=True)
    for text in args.setting:
        options = {"t": 0.6, "gamma": 0.05, **json.loads(text)}
        start = time.time()
        with kv_cache_factory(model, "minicache", **options) as make:
            res = run_tasks(model, tok, samples, make)
        o = res["overall"]
        print(json.dumps({"setting": options, "accuracy": o["accuracy"], "compression_ratio": round(o["compression_ratio"], 4),
                          "counters": o["counters"], "seconds": round(time.time() - start, 1)}), flush=True)


if __name__ == "__main__":
    main()
