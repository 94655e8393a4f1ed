"""Where one training step's memory and host synchronisations go (issue 17's profile of a miss).

For one variant of ``train_memory.py`` (default ``d``: Llama-3-8B shapes, NeuZip lossless +
fused LOMO, activation checkpointing), after warm-up steps:

* **peak**: the caching allocator's history over one step (``torch.cuda.memory._record_memory_history``)
  replayed to the moment of peak allocated bytes; every block alive then of at least ``--min-mib``,
  with the innermost neutrain / transformers frames that allocated it;
* **segments**: the allocator's segments at that moment (reserved vs allocated, largest free block);
* **syncs**: every host-synchronising CUDA call of one step (profiler, with Python stacks), with
  the frames that caused it.

Writes ``benchmarks/results/<name>.json`` (default ``step_anatomy``). A diagnostic: it has no targets.

    python benchmarks/step_anatomy.py --variant d --batch 1
    python benchmarks/step_anatomy.py --tiny            # smoke test (CUDA required)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

KEEP_FRAMES = ("neutrain/", "transformers/", "torch/utils/checkpoint", "benchmarks/")


def _frames(stack, limit: int = 6) -> list[str]:
    """The innermost frames from neutrain, transformers and the checkpoint recompute."""
    out = []
    for f in stack:
        name = f.get("filename", "") if isinstance(f, dict) else f.filename
        line = f.get("line", 0) if isinstance(f, dict) else f.lineno
        func = f.get("name", "") if isinstance(f, dict) else f.name
        if any(k in name for k in KEEP_FRAMES):
            out.append(f"{name.split('site-packages/')[-1].split('/work/')[-1]}:{line} {func}")
        if len(out) >= limit:
            break
    return out


def peak_blocks(snapshot: dict, min_bytes: int) -> dict:
    """Replay the allocator trace to the peak of allocated bytes; the blocks alive then."""
    events = [e for trace in snapshot["device_traces"] for e in trace]
    live: dict[int, dict] = {}
    current = best = 0
    best_live: dict[int, dict] = {}
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            current += e["size"]
        elif e["action"] in ("free_completed",):
            gone = live.pop(e["addr"], None)
            if gone is not None:
                current -= gone["size"]
        if current > best:
            best, best_live = current, dict(live)
    blocks = sorted((b for b in best_live.values() if b["size"] >= min_bytes), key=lambda b: -b["size"])
    return {"traced_peak_over_start_gib": round(best / 2**30, 3),
            "blocks": [{"mib": round(b["size"] / 2**20, 1), "frames": _frames(b.get("frames", []))} for b in blocks]}


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def sync_sites(step) -> list[dict]:
    """Run ``step`` under the profiler (with Python stacks); each host-synchronising CUDA call and its frames.

    ``set_sync_debug_mode("warn")`` would name them too, but its warnings are raised inside autograd's
    worker thread during backward, where a Python handler cannot run safely; the profiler's CPU events
    carry the Python stack of the op that issued each runtime call.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        step()
    sites = []
    for ev in prof.events():
        name = ev.name
        if not name.startswith(SYNC_CALLS) or name.startswith("cudaMemcpyAsync"):
            continue
        parent, chain = ev, []
        while parent is not None and not parent.stack:
            chain.append(parent.name)
            parent = parent.cpu_parent
        frames = [f for f in (parent.stack if parent is not None else []) if any(k in f for k in KEEP_FRAMES)]
        sites.append({"call": name, "ops": chain[1:4] + ([parent.name] if parent is not None else []),
                      "frames": [f.split("site-packages/")[-1].split("/work/")[-1] for f in frames[:6]]})
    return sites


def persistent_bytes(model) -> dict:
    """GiB held by the compressed weights' buffers, by buffer, and by dense parameters (norms)."""
    from neutrain.nn import compressed_weights

    parts: dict[str, float] = {}
    for weight in compressed_weights(model):
        ct = weight.ct
        for attr in ("stream", "tails", "lane_words", "tile_base", "lut"):
            t = getattr(ct, attr, None)
            if t is not None and hasattr(t, "numel"):
                parts[attr] = parts.get(attr, 0.0) + t.numel() * t.element_size() / 2**30
    dense = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    return {"compressed_gib_by_buffer": {k: round(v, 3) for k, v in parts.items()},
            "compressed_gib": round(sum(parts.values()), 3), "dense_parameters_gib": round(dense, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="d", help="a train_memory.py variant (neutrain's own: c, d, e, f)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--min-mib", type=float, default=48.0)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--name", default="step_anatomy")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from benchmarks import _train_peers as peers
    from benchmarks._common import git_provenance, write_result
    from benchmarks.train_memory import LLAMA3_8B, TINY, VARIANTS
    from neutrain.nn import causal_lm_loss
    from neutrain.nn.load import init_compressed
    from neutrain.optim import OPTIMIZERS

    git_provenance()
    weights, opt_name = VARIANTS[args.variant]
    config = LlamaConfig(**(TINY if args.tiny else LLAMA3_8B))
    config._attn_implementation = "sdpa"
    if weights == "dense":
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    else:
        model, _ = init_compressed(config, weights, "cuda", dtype=torch.bfloat16, progress=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    opt = OPTIMIZERS[opt_name](model.parameters(), lr=1e-4, clip_mode="per_tensor", max_grad_norm=1.0).bind(model)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda")

    def step():
        opt.backward(causal_lm_loss(model, ids, ids))
        opt.step()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() / 2**30
    # Python stacks only: capturing C++ stacks inside autograd's worker thread during a checkpoint
    # recompute failed on torch 2.11 (SystemError from the recomputed autograd Function).
    torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
    try:
        step()
    except SystemError:
        torch.cuda.memory._record_memory_history(enabled=None)
        torch.cuda.memory._record_memory_history(max_entries=400_000, context=None)
        step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    result = {"memory": peers.memory_row(), "allocated_before_step_gib": round(before, 3),
              "persistent": persistent_bytes(model),
              "peak": peak_blocks(snapshot, int(args.min_mib * 2**20)), "segments": peers.segment_map(top=12)}
    print(result["memory"], "before the step:", result["allocated_before_step_gib"], result["persistent"])
    print("peak over the step's start:", result["peak"]["traced_peak_over_start_gib"], "GiB; blocks alive then:")
    for b in result["peak"]["blocks"][:30]:
        print(f"{b['mib']:9.1f} MiB  {' <- '.join(b['frames'][:3])}")
    print(json.dumps(result["segments"])[:1500])
    try:
        syncs = sync_sites(step)
    except Exception as exc:  # a diagnostic: keep the memory part
        syncs = [{"error": repr(exc)[:300]}]
    torch.cuda.synchronize()
    result["syncs"] = {"count": len(syncs), "sites": syncs}
    print("host syncs in one step:", len(syncs))
    for site in syncs:
        print("  ", site)
    write_result(args.name, {"variant": args.variant, "batch": args.batch, "seq": args.seq, "tiny": args.tiny,
                             "min_mib": args.min_mib}, result,
                 targets_note="a diagnostic of train_memory.py's step (issue 17's profile of a miss); no goal")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
