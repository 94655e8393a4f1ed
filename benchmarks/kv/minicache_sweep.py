"""MiniCache settings on the real model on CPU: accuracy gap and measured compression, per setting.

Same evaluation as the benchmark's real-model part (``benchmarks/kv/_kv_real.py``: niah_single, SmolLM2's own
tokenizer, no chat template, seed-42 samples, greedy), through the library's ``run_tasks``; one JSON line per
setting, so a long sweep can be read while it runs, then the ``<--name>`` row of ``benchmarks/kv/results.jsonl``
(``write_result``; the paper's setting, t 0.6 and gamma 0.05 from the middle layer, is the benchmark's
``minicache_merge`` and gives ``real_model_minicache_acc_gap_points``).

Usage:
    PYTHONPATH=. python benchmarks/kv/minicache_sweep.py --len 1024 --samples 10 \
        --setting '{"start_layer": 28}' --setting '{"gamma": 0.5}'
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks._common import write_result  # noqa: E402
from benchmarks.kv._kv_targets import targets_of_a_study  # noqa: E402

from neutrain.eval.loop import kv_cache_factory, run_tasks  # noqa: E402

PAPER = {"t": 0.6, "gamma": 0.05}  # the benchmark's minicache_merge


def label(options: dict) -> str:
    """The benchmark's label for the paper's setting, else one naming what differs from it."""
    extra = {k: v for k, v in options.items() if PAPER.get(k) != v}
    return "minicache_merge" + "".join(f"_{k}{v}" for k, v in sorted(extra.items()))


def main():
    from neutrain.eval.real_model import load_smollm2
    from neutrain.eval.tasks import generate_task

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--len", type=int, default=1024)
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--setting", action="append", default=[], help="MiniCache options as JSON (t, gamma default 0.6, 0.05)")
    p.add_argument("--name", default="minicache_smollm2_start_layer_sweep", help="the record's name (its row in benchmarks/kv/results.jsonl)")
    args = p.parse_args()
    model, tok = load_smollm2()
    samples = {"niah_single": generate_task("niah_single", tok, args.len, args.samples, seed=42)}
    start = time.time()
    with kv_cache_factory(model, "full") as make:
        res = run_tasks(model, tok, samples, make)
    rows = [{"setting": "full", "accuracy": res["overall"]["accuracy"], "seconds": round(time.time() - start, 1)}]
    print(json.dumps(rows[-1]), flush=True)
    for text in args.setting:
        options = {**PAPER, **json.loads(text)}
        start = time.time()
        with kv_cache_factory(model, "minicache", **options) as make:
            res = run_tasks(model, tok, samples, make)
        o = res["overall"]
        rows.append({"setting": options, "label": label(options), "accuracy": o["accuracy"],
                     "compression_ratio": round(o["compression_ratio"], 4), "counters": o["counters"],
                     "seconds": round(time.time() - start, 1)})
        print(json.dumps(rows[-1]), flush=True)
    full = rows[0]["accuracy"]
    gaps = {"full": 0.0, **{row["label"]: round(full - row["accuracy"], 2) for row in rows[1:]}}
    settings = {"model": "SmolLM2-135M-Instruct", "task": "niah_single", "seed": 42, "tokens": args.len,
                "samples": args.samples, "device": "cpu"}
    targets = targets_of_a_study({"real": {"gap_points": gaps}},
                                 "this sweep measures MiniCache on the real model only")
    print("wrote", write_result(args.name, settings, {"rows": rows, "real": {"gap_points": gaps}},
                                targets=targets))


if __name__ == "__main__":
    main()
