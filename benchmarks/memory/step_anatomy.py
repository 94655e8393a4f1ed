"""Where one training step's memory and host synchronisations go (the profile of a missed memory target).

For one variant of ``train_memory.py`` (default ``d``: Llama-3-8B shapes, NeuZip lossless +
fused LOMO, activation checkpointing), after warm-up steps:

* **peak moments**: each moment of one step at which the allocator's peak rose, with the Python
  frames running then and the largest live blocks (the last one is the step's peak);
* **segments**: the allocator's segments at that moment (reserved vs allocated, largest free block);
* **syncs**: every host-synchronising CUDA call of one step (profiler, with Python stacks), with
  the frames that caused it.

Writes the ``<name>`` row of ``benchmarks/memory/results.jsonl`` (default ``step_anatomy``). A diagnostic: it has no targets.

    python benchmarks/memory/step_anatomy.py --variant d --batch 1
    python benchmarks/memory/step_anatomy.py --tiny            # smoke test (CUDA required)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

KEEP_FRAMES = ("neutrain/", "transformers/", "torch/utils/checkpoint", "benchmarks/")


def peak_moments(step, min_rise_mib: float = 8.0, top: int = 10) -> list[dict]:
    """Run ``step`` with a Python profile hook on every thread; each time the allocator's peak (allocated or reserved) rises.

    After every Python or C function return, ``max_memory_allocated`` is read (host-side counters,
    no sync); when it rose by ``min_rise_mib`` since the last record, the Python frames (neutrain,
    transformers) and the largest live blocks are recorded. The last record is the step's peak.
    (``torch.cuda.memory._record_memory_history`` would give every block's stack, but on torch 2.11
    it broke the checkpoint recompute of an autograd Function: SystemError.)
    """
    import threading

    import torch

    records: list[dict] = []
    state = {"peak": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}
    rise = int(min_rise_mib * 2**20)

    def hook(frame, event, arg):
        if event not in ("return", "c_return"):
            return
        peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        if peak < state["peak"] + rise and reserved < state["reserved"] + rise:
            return
        state["peak"], state["reserved"] = max(peak, state["peak"]), max(reserved, state["reserved"])
        stack, f = [], frame
        while f is not None and len(stack) < 6:
            name = f.f_code.co_filename
            if any(k in name for k in KEEP_FRAMES):
                stack.append(f"{name.split('site-packages/')[-1].split('/work/')[-1]}:{f.f_lineno} {f.f_code.co_name}")
            f = f.f_back
        blocks = sorted((b["size"] for seg in torch.cuda.memory_snapshot() for b in seg["blocks"]
                         if b["state"] == "active_allocated"), reverse=True)[:top]
        records.append({"peak_gib": round(peak / 2**30, 3), "peak_reserved_gib": round(reserved / 2**30, 3),
                        "allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 3),
                        "call": getattr(arg, "__qualname__", None) if event == "c_return" else frame.f_code.co_name,
                        "frames": stack, "largest_live_mib": [round(b / 2**20, 1) for b in blocks]})

    threading.setprofile_all_threads(hook) if hasattr(threading, "setprofile_all_threads") else sys.setprofile(hook)
    try:
        step()
        torch.cuda.synchronize()
    finally:
        if hasattr(threading, "setprofile_all_threads"):
            threading.setprofile_all_threads(None)
        else:
            sys.setprofile(None)
    return records


def sync_sites(step) -> list[dict]:
    """Run ``step`` under the profiler (with Python stacks); each host-synchronising CUDA call and its frames.

    ``set_sync_debug_mode("warn")`` would name them too, but its warnings are raised inside autograd's
    worker thread during backward, where a Python handler cannot run safely; the profiler's CPU events
    carry the Python stack of the op that issued each runtime call.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.memory._train_peers import is_host_sync

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        step()
    sites = []
    for ev in prof.events():
        name = ev.name
        if not is_host_sync(name):
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


def targets_of(args, memory: dict) -> dict:
    """``train_memory.py``'s batch-1 memory targets, when this run measured that setting (variant d, batch 1, 8B)."""
    if args.variant != "d" or args.batch != 1 or args.tiny:
        return {}
    return {name: {"value": round(memory[field], 3), "goal": f"<= {goal}", "met": memory[field] <= goal,
                   "derived_from": f"results.memory.{field}"}
            for name, field, goal in (("d_device_used_gib_batch1", "device_used_gib", 14.5),
                                      ("d_peak_reserved_gib_batch1", "peak_reserved_gib", 11.5))
            if memory.get(field) is not None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="d", help="a train_memory.py variant (neutrain's own: c, d, e, f)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--name", default="step_anatomy")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from benchmarks.memory import _train_peers as peers
    from benchmarks._common import git_provenance, write_result
    from benchmarks.memory.train_memory import LLAMA3_8B, TINY, VARIANTS
    from neutrain.nn import causal_lm_loss
    from neutrain.nn.load import init_compressed
    from neutrain.optim import optimizer_spec

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
    rule = optimizer_spec(opt_name).resolve()
    opt = rule(model.parameters(), lr=1e-4, clip_mode="per_tensor", max_grad_norm=1.0).bind(model)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda")

    def step():
        opt.backward(causal_lm_loss(model, ids, ids))
        opt.step()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() / 2**30
    moments = peak_moments(step)
    result = {"memory": peers.memory_row(), "allocated_before_step_gib": round(before, 3),
              "persistent": persistent_bytes(model),
              "peak_moments": moments, "segments": peers.segment_map(top=12)}
    print(result["memory"], "before the step:", result["allocated_before_step_gib"], result["persistent"])
    print("where the allocator's peak rose (the last line is the step's peak):")
    for m in moments[-14:]:
        print(f"  {m['peak_gib']:7.3f} GiB resv {m['peak_reserved_gib']:7.3f} (now {m['allocated_gib']:.3f}) {m['call']} <- {' <- '.join(m['frames'][:3])}"
              f"  largest live MiB {m['largest_live_mib'][:6]}")
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
    write_result(args.name, {"variant": args.variant, "batch": args.batch, "seq": args.seq, "tiny": args.tiny}, result,
                 targets=targets_of(args, result["memory"]),
                 targets_note="a diagnostic of train_memory.py's step (the profile of a missed memory target)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
