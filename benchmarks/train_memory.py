"""Peak memory and throughput of full fine-tuning, Llama-3-8B architecture, one GPU (issue 4).

Variants, each in a fresh subprocess so the allocator starts clean:

    a  dense + AdamW through the Hugging Face Trainer (OOM is a result)
    b  dense + SGD with full gradients
    c  dense + fused LOMO
    d  NeuZip lossless + fused LOMO
    e  NeuZip lossless + AdaLomo

Random init, sequence 1024, bf16, activation checkpointing on. Memory at batch 1;
throughput at batch 8 (and batch 1). Each row carries peak allocated/reserved GiB,
the device's used memory (NVML, or cudaMemGetInfo), tokens/s and the planner's estimate.

    python benchmarks/train_memory.py                    # all variants, writes results/train_memory.json
    python benchmarks/train_memory.py --tiny --variants c,d   # CPU/GPU smoke test on a tiny model
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

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
VARIANTS = {
    "a": ("dense", "adamw-hf"), "b": ("dense", "sgd"), "c": ("dense", "lomo"),
    "d": ("neuzip-lossless", "lomo"), "e": ("neuzip-lossless", "adalomo"),
    "h": ("dense", "lomo-hf"),  # Hugging Face's own optim="lomo" (pip lomo-optim), the comparison the issue names
}


def _device_used_gib() -> float | None:
    import torch

    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**30
    except Exception:
        free, total = torch.cuda.mem_get_info()
        return (total - free) / 2**30


def run_variant(key: str, tiny: bool, seq: int, batches: list[int], steps: int) -> dict:
    """One variant in this process: build, train a few steps per batch size, measure."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from neutrain.trainer.planner import ModelShape, estimate

    weights, opt_name = VARIANTS[key]
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    config = LlamaConfig(**(TINY if tiny else LLAMA3_8B))
    config._attn_implementation = "sdpa"
    t0 = time.perf_counter()
    if weights == "dense":
        with torch.device(device):  # initialised in place on the GPU, N(0, 0.02) like init_compressed
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    else:
        from neutrain.nn.load import init_compressed

        model, _ = init_compressed(config, weights, device, dtype=torch.bfloat16, progress=False)
    build_s = time.perf_counter() - t0
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    from neutrain.nn import causal_lm_loss

    if opt_name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    elif opt_name in ("lomo", "adalomo"):
        from neutrain.optim import OPTIMIZERS

        opt = OPTIMIZERS[opt_name](model.parameters(), lr=1e-4, clip_mode="per_tensor", max_grad_norm=1.0).bind(model)
    result: dict = {"variant": key, "weights": weights, "optimizer": opt_name, "build_s": round(build_s, 1)}
    if opt_name in ("adamw-hf", "lomo-hf"):
        return {**result, **_run_hf_trainer(model, config, seq, steps, optim=opt_name[:-3])}

    def step(batch: int):
        ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
        loss = causal_lm_loss(model, ids, ids)
        if opt_name == "sgd":
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            opt.backward(loss)
            opt.step()
        return loss

    for batch in batches:
        try:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            times = []
            for i in range(steps):
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                t = time.perf_counter()
                loss = step(batch)
                if cuda:
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) / 1e3)
                else:
                    times.append(time.perf_counter() - t)
            warm = times[2:] if len(times) > 3 else times[1:]
            med = sorted(warm)[len(warm) // 2]
            row = {"tokens_per_s": batch * seq / med, "step_s": med, "loss": float(loss)}
            if cuda:
                row.update(peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
                           peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30, device_used_gib=_device_used_gib())
        except torch.OutOfMemoryError as exc:
            row = {"oom": True, "error": str(exc).splitlines()[0][:200]}
            opt.zero_grad(set_to_none=True) if hasattr(opt, "zero_grad") else None
            torch.cuda.empty_cache()
        est = estimate(ModelShape.from_config(config), batch=batch, seq=seq, weights=weights, optimizer=opt_name,
                       checkpointing=True, chunked_loss=True)
        row["planner_gib"] = est.total_gib
        row["planner_terms_gib"] = {k: v / 2**30 for k, v in est.terms.items()}
        result[f"batch{batch}"] = row
    return result


def _run_hf_trainer(model, config, seq: int, steps: int, optim: str = "adamw") -> dict:
    """Variants (a) and (h): the ordinary Hugging Face Trainer with AdamW or its own LOMO, batch 1."""
    import tempfile

    import torch
    from datasets import Dataset  # noqa: F401  (the Trainer accepts any torch Dataset)
    from transformers import Trainer, TrainingArguments

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            ids = torch.randint(0, config.vocab_size, (seq,))
            return {"input_ids": ids, "labels": ids}

    args = TrainingArguments(tempfile.mkdtemp(), per_device_train_batch_size=1, max_steps=steps, optim="adamw_torch" if optim == "adamw" else optim,
                             bf16=True, logging_steps=1, report_to="none", save_strategy="no", learning_rate=1e-5,
                             **__import__("neutrain.compat", fromlist=["x"]).checkpointing_training_args(True))
    torch.cuda.reset_peak_memory_stats()
    try:
        t = time.perf_counter()
        Trainer(model=model, args=args, train_dataset=Rows()).train()
        row = {"tokens_per_s": steps * seq / (time.perf_counter() - t)}
    except torch.OutOfMemoryError as exc:
        row = {"oom": True, "error": str(exc).splitlines()[0][:200]}
    row.update(peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30, peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
               device_used_gib=_device_used_gib())
    from neutrain.trainer.planner import ModelShape, estimate

    row["planner_gib"] = estimate(ModelShape.from_config(config), batch=1, seq=seq, optimizer=optim, checkpointing=True,
                                  chunked_loss=False).total_gib
    return {"batch1": row}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="d,c,e,b,a", help="most important first: partial runs keep them")
    ap.add_argument("--tiny", action="store_true", help="tiny model (smoke test)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--name", default="train_memory")
    ap.add_argument("--timeout", type=float, default=240, help="seconds per variant")
    args = ap.parse_args()
    if not args.child:
        from benchmarks._common import git_provenance

        git_provenance()  # fail now, not after the measurement, if the commit cannot be recorded
    if args.child:
        res = run_variant(args.child, args.tiny, args.seq, [1, 8], args.steps)
        print("RESULT " + json.dumps(res))
        return 0
    rows = []
    for key in args.variants.split(","):
        cmd = [sys.executable, __file__, "--child", key, "--seq", str(args.seq), "--steps", str(args.steps)] + (["--tiny"] if args.tiny else [])
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
            row = json.loads(line[7:]) if line else {"variant": key, "failed": True, "stderr": proc.stderr[-1500:]}
        except subprocess.TimeoutExpired:
            row = {"variant": key, "failed": True, "timeout_s": args.timeout}
        row["wall_s"] = round(time.perf_counter() - t, 1)
        rows.append(row)
        print(json.dumps(row)[:600], flush=True)
        _write(args, rows)  # after every variant, so a cut-off run keeps what it measured
    return 0


def _write(args, rows) -> None:
    from benchmarks._common import write_result

    by = {r["variant"]: r for r in rows}
    headline = ""
    if "d" in by and "batch1" in by["d"] and "peak_allocated_gib" in by["d"]["batch1"]:
        d1, d8 = by["d"]["batch1"], by["d"].get("batch8", {})
        headline = f"(d) NeuZip+LOMO peak {d1['peak_allocated_gib']:.2f} GiB (planner {d1['planner_gib']:.2f})"
        if "c" in by and "batch8" in by["c"] and "tokens_per_s" in by["c"]["batch8"] and "tokens_per_s" in d8:
            headline += f"; {d8['tokens_per_s']:.0f} tok/s at batch 8 = {d8['tokens_per_s'] / by['c']['batch8']['tokens_per_s']:.2f}x of (c)"
        if "c" in by and "peak_allocated_gib" in by["c"].get("batch1", {}):
            headline += f"; (c) dense+LOMO {by['c']['batch1']['peak_allocated_gib']:.2f} GiB"
    if "h" in by and "peak_allocated_gib" in by["h"].get("batch1", {}):
        headline += f"; HF optim=lomo {by['h']['batch1']['peak_allocated_gib']:.2f} GiB"
    write_result(args.name, {"seq": args.seq, "steps": args.steps, "tiny": args.tiny, "model": "tiny" if args.tiny else "llama3-8b",
                             "activation_checkpointing": True, "dtype": "bfloat16"}, {"variants": rows, "headline": headline})


if __name__ == "__main__":
    raise SystemExit(main())
