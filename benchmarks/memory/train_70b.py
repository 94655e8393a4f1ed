"""Llama-3-70B full fine-tuning on one GPU: NeuZip lossless + fused LOMO, activation checkpointing.

How many tokens one step can take on one H200, and tokens per second at 16K.
The model is the Llama-3-70B architecture (80 layers, hidden 8192, vocabulary 128,256) built
compressed on the GPU with random N(0, 0.02) weights (`neutrain.nn.load.init_compressed`: no dense
copy of the model ever exists); batch 1, one sequence of ``seq`` tokens per step. For each length:
step time by CUDA events (median after a warm-up step), peak allocated, peak reserved and device
memory in use (NVML), and the planner's prediction; an out-of-memory step is recorded as such, with
the allocator's numbers at the failure. Then the lengths of ``--offload-seqs`` with
``memory.offload_activations`` (each layer's saved input in pinned host memory, :mod:`neutrain.nn.offload`),
with the bytes sent to the host per step.

    python benchmarks/memory/train_70b.py                       # 16K, 32K, 24K if 32K does not fit; then 32K offloaded
    python benchmarks/memory/train_70b.py --tiny --seqs 64,128  # smoke test (CPU or GPU)

Writes ``benchmarks/memory/results.jsonl#train_70b`` with targets ``max_tokens_per_step`` (>= 32,768) and
``tokens_per_s_16k`` (>= 850).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from benchmarks.memory.train_memory import LLAMA3_8B, TINY as TINY_8B  # noqa: E402

# The 70B differs from the 8B in width, depth, heads and context; vocabulary, RoPE and norms are shared.
LLAMA3_70B = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64, "max_position_embeddings": 131072}
TINY = {**TINY_8B, "max_position_embeddings": 4096}  # room for the smoke test's lengths


def measure(model, opt, vocab: int, seq: int, steps: int, device: str) -> dict:
    """``steps`` training steps of one ``seq``-token sequence; the first is warm-up."""
    import torch

    from benchmarks.memory import _train_peers as peers
    from neutrain.nn import causal_lm_loss

    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, loss = [], None
    try:
        for _ in range(steps):
            ids = torch.randint(0, vocab, (1, seq), device=device)
            t0 = time.perf_counter()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            opt.backward(causal_lm_loss(model, ids, ids))
            opt.step()
            if cuda:
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                times.append(time.perf_counter() - t0)
            loss = opt.last_grad_norm  # keep the graph-free scalar only
        step_s = statistics.median(times[1:] if len(times) > 1 else times)
        row = {"ok": True, "step_s": round(step_s, 3), "tokens_per_s": round(seq / step_s, 1), "steps": steps,
               "grad_norm": None if loss is None else round(float(loss), 4)}
    except torch.OutOfMemoryError as exc:
        row = {"ok": False, "oom": True, "error": str(exc).splitlines()[0][:300]}
        opt.zero_grad(set_to_none=True)
        opt.accumulation.reset()
    if cuda:
        row.update(peers.memory_row())
        if not row["ok"]:
            row["segment_map"] = peers.segment_map(top=6)
            torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="16384,32768", help="sequence lengths to try, in order")
    ap.add_argument("--fallback", type=int, default=24576, help="length tried when every longer one failed")
    ap.add_argument("--offload-seqs", default="32768",
                    help="lengths tried afterwards with memory.offload_activations (saved layer inputs in host memory)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--name", default="train_70b")
    ap.add_argument("--clip-mode", default="per_tensor", choices=("per_tensor", "global_stale", "global_exact"),
                    help="LOMO's clipping at max_grad_norm 1.0 (global_stale: no second lm_head gradient pass)")
    args = ap.parse_args()

    import torch
    from transformers import LlamaConfig

    from benchmarks._common import git_provenance, write_result
    from neutrain.nn.load import init_compressed
    from neutrain.nn.offload import STATS, offload_checkpointed_inputs
    from neutrain.optim import LOMO
    from neutrain.memory import ModelShape, estimate

    git_provenance()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = LlamaConfig(**(TINY if args.tiny else LLAMA3_70B))
    config._attn_implementation = "sdpa"
    t0 = time.perf_counter()
    model, _ = init_compressed(config, "neuzip-lossless", device, dtype=torch.bfloat16, progress=False)
    build_s = time.perf_counter() - t0
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    opt = LOMO(model.parameters(), lr=1e-5, clip_mode=args.clip_mode, max_grad_norm=1.0).bind(model)
    from neutrain.nn import compressed_weights

    weights_gib = sum(w.nbytes for w in compressed_weights(model)) / 2**30
    print(f"built in {build_s:.0f} s; compressed weights {weights_gib:.2f} GiB", flush=True)

    seqs = [int(s) for s in args.seqs.split(",")]
    rows: dict[str, dict] = {}

    def run(seq: int, offload: bool = False) -> bool:
        STATS.reset()
        row = measure(model, opt, config.vocab_size, seq, args.steps, device)
        est = estimate(ModelShape.from_config(config), batch=1, seq=seq, weights="neuzip-lossless",
                       optimizer="lomo", checkpointing=True, offload_activations=offload, chunked_loss=True)
        row["planner_gib"] = round(est.total_gib, 3)
        row["planner_reserved_gib"] = round(est.reserved / 2**30, 3)
        if offload:
            row["offload_activations"] = True
            row["host_bytes_per_step_gib"] = round(STATS.packed_bytes / max(1, args.steps) / 2**30, 3)
        rows[f"{seq}{'_offload' if offload else ''}"] = row
        print(seq, "offload" if offload else "", row, flush=True)
        return row["ok"]

    fitted = [s for s in seqs if run(s)]
    if args.fallback and not any(s > args.fallback for s in fitted) and str(args.fallback) not in rows:
        if run(args.fallback):
            fitted.append(args.fallback)
    offload_seqs = [int(s) for s in args.offload_seqs.split(",") if s]
    if offload_seqs:
        offload_checkpointed_inputs(model)
        fitted_offload = [s for s in offload_seqs if run(s, offload=True)]
    else:
        fitted_offload = []
    max_tokens = max(fitted + fitted_offload, default=0)
    targets = {"max_tokens_per_step": {
        "value": max_tokens, "goal": ">= 32768", "met": max_tokens >= 32768,
        "setting": "memory.offload_activations" if max_tokens in fitted_offload and max_tokens not in fitted else "plain",
        "max_without_offload": max(fitted, default=0)}}
    r16 = rows.get("16384", {})
    if r16.get("ok"):
        targets["tokens_per_s_16k"] = {"value": r16["tokens_per_s"], "goal": ">= 850", "met": r16["tokens_per_s"] >= 850}
    write_result(args.name, {"model": "tiny" if args.tiny else "llama3-70b", "weights": "neuzip-lossless",
                             "optimizer": f"lomo (fused, {args.clip_mode} clip 1.0)", "batch": 1,
                             "activation_checkpointing": True, "steps_per_length": args.steps,
                             "alloc_conf": __import__("os").environ.get("PYTORCH_CUDA_ALLOC_CONF")},
                 {"build_s": round(build_s, 1), "compressed_weights_gib": round(weights_gib, 3), "by_seq": rows},
                 targets=targets)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
