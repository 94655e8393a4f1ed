"""Weight offload: compressed weights in pinned host memory, streamed to the GPU layer by layer.

Parts, separable with ``--parts`` so that each device call stays under its time limit; each runs in its
own process (:mod:`benchmarks._isolated`), and ``offload.json`` is written again after each one, so a
CUDA fault in one part (the 8B's offloaded step once died of ``an illegal memory access``, which took the
in-GPU numbers of the same process with it) costs only that part, recorded as one ``failed`` line:

* ``link``: host<->device bandwidth with pinned memory, each direction and both at once (1 GiB copies).
* ``8b`` (= ``8b_gpu`` then ``8b_offload``, two processes): Llama-3-8B (``benchmarks/memory/train_memory.py``'s
  config, NeuZip lossless + fused LOMO, activation checkpointing) at batch 8 x 1024, fully on the GPU;
  then a freshly built one with ``memory.offload_weights`` under a GPU budget of 8 GiB
  (``torch.cuda.set_per_process_memory_fraction``); the saved layer inputs go to host memory too when
  the planner says weights alone would not fit. Target ``offload_8b_over_in_gpu`` (>= 0.85).
* ``70b``: the Llama-3-70B architecture (``benchmarks/memory/train_70b.py``'s config) built layer by layer on
  the GPU straight into the host store (``neutrain.nn.load.build`` with an offloading placement), one sequence
  of 16,384 tokens per step, >= 3 steps. Targets ``h100_70b_tokens_per_s_16k`` (>= 620) and
  ``h100_70b_peak_reserved_gib`` (<= 70); host memory pinned, bytes moved per step against the link, and
  the timeline of one step per layer (copy in, compute, write-back; decode and encode kernel totals).

    python benchmarks/offload/offload.py --parts link,8b            # one device call
    python benchmarks/offload/offload.py --parts 70b --merge        # a second one, merged into the same file
    python benchmarks/offload/offload.py --tiny --parts link,8b,70b # smoke test (GPU)
    NEUTRAIN_OFFLOAD_SYNC_DEBUG=1 python benchmarks/offload/offload.py --parts 8b_offload --steps 2
        # a device sync and a payload check after each fetch, decode and write-back: the fault, if any,
        # is named by call, layer and weight (neutrain/nn/offload_debug.py; timings then mean nothing)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # neutrain train's default
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from benchmarks.memory.train_70b import LLAMA3_70B
from benchmarks.memory.train_70b import TINY as TINY_70B
from benchmarks.memory.train_memory import LLAMA3_8B
from benchmarks.memory.train_memory import TINY as TINY_8B

GIB = 2**30
NAME = "offload"


def link_bandwidth(nbytes: int = GIB, reps: int = 5) -> dict:
    """GB/s of pinned host<->device copies: each direction alone, then both at once on two streams."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    back = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev, dev2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda"), torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / reps

    def both():
        with torch.cuda.stream(s1):
            dev.copy_(host, non_blocking=True)
        with torch.cuda.stream(s2):
            back.copy_(dev2, non_blocking=True)

    h2d = timed(lambda: dev.copy_(host, non_blocking=True))
    d2h = timed(lambda: back.copy_(dev2, non_blocking=True))
    duplex = timed(both)
    return {"h2d_gb_s": round(nbytes / h2d / 1e9, 2), "d2h_gb_s": round(nbytes / d2h / 1e9, 2),
            "both_ways_gb_s_each": round(nbytes / duplex / 1e9, 2), "copy_bytes": nbytes}


def _steps(model, opt, vocab: int, batch: int, seq: int, steps: int, store=None) -> dict:
    """``steps`` training steps; median of the warm ones (CUDA events), peak memory, copies per step."""
    import torch

    from benchmarks.memory import _train_peers as peers
    from neutrain.nn import causal_lm_loss

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(steps):
        if store is not None and i == steps - 1:
            store.stats.reset()  # the last step's copies (a steady-state step)
        ids = torch.randint(0, vocab, (batch, seq), device="cuda")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.backward(causal_lm_loss(model, ids, ids))
        opt.step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    warm = times[1:] if len(times) > 1 else times
    step_s = statistics.median(warm)
    row = {"step_s": round(step_s, 4), "tokens_per_s": round(batch * seq / step_s, 1), "steps": steps,
           "step_times_s": [round(t, 4) for t in times], **peers.memory_row()}
    if store is not None:
        st = store.stats
        row.update(h2d_gib_per_step=round(st.h2d_bytes / GIB, 3), d2h_gib_per_step=round(st.d2h_bytes / GIB, 3),
                   layer_loads_per_step=st.loads, stalls_per_step=st.stalls, slot_regrows=st.regrows,
                   pinned_host_gib=round(store.pinned_bytes / GIB, 3), slot_device_gib=round(store.device_bytes / GIB, 3))
    return row


def timeline(model, opt, vocab: int, batch: int, seq: int, store) -> dict:
    """One step with the store's copy events and the profiler: per-layer copy/compute times and overlap."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from neutrain.nn import causal_lm_loss

    store.timeline = []
    ids = torch.randint(0, vocab, (batch, seq), device="cuda")
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        opt.backward(causal_lm_loss(model, ids, ids))
        opt.step()
        end.record()
        torch.cuda.synchronize()
    events, store.timeline = store.timeline, None
    rows = [{"kind": k, "layer": i, "start_ms": round(start.elapsed_time(s), 2),
             "ms": None if e is None else round(s.elapsed_time(e), 2)} for k, i, s, e in events]
    kinds = {"decode": ("decode",), "encode": ("count_lossless", "pack_lossless"),
             "gemm": ("gemm", "sm90", "cutlass", "nvjet"), "attention": ("flash", "attention", "fmha")}
    busy = {k: 0.0 for k in (*kinds, "other_compute", "memcpy_h2d", "memcpy_d2h")}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name, ms = ev.name.lower(), ev.device_time / 1e3
        if "memcpy" in name:
            busy["memcpy_h2d" if "htod" in name else "memcpy_d2h" if "dtoh" in name else "other_compute"] += ms
            continue
        kind = next((k for k, keys in kinds.items() if any(key in name for key in keys)), "other_compute")
        busy[kind] += ms
    wall = start.elapsed_time(end)
    compute = sum(v for k, v in busy.items() if not k.startswith("memcpy"))
    copies = busy["memcpy_h2d"] + busy["memcpy_d2h"]
    layers = max(1, len(store.layers))
    return {"step_wall_ms_profiled": round(wall, 1), "busy_ms": {k: round(v, 1) for k, v in busy.items()},
            "per_layer_ms": {k: round(v / layers, 2) for k, v in busy.items()},
            "copy_hidden_share": round(max(0.0, min(1.0, (compute + copies - wall) / copies)) if copies else 1.0, 3),
            "events": rows[:4 * layers * 3]}


def _build_8b(args):
    import torch
    from transformers import LlamaConfig

    from neutrain.nn.load import init_compressed
    from neutrain.optim import LOMO

    config = LlamaConfig(**(TINY_8B if args.tiny else LLAMA3_8B))
    config._attn_implementation = "sdpa"
    t0 = time.perf_counter()
    model, _ = init_compressed(config, "neuzip-lossless", "cuda", dtype=torch.bfloat16, progress=False)
    build_s = time.perf_counter() - t0
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    opt = LOMO(model.parameters(), lr=1e-5, clip_mode="per_tensor", max_grad_norm=1.0).bind(model)
    batch, seq = (2, 64) if args.tiny else (8, 1024)
    return config, model, opt, batch, seq, round(build_s, 1)


def part_8b_gpu(args) -> dict:
    config, model, opt, batch, seq, build_s = _build_8b(args)
    in_gpu = _steps(model, opt, config.vocab_size, batch, seq, args.steps)
    print("8b in GPU", in_gpu, flush=True)
    return {"build_s": build_s, "batch": batch, "seq": seq, **in_gpu}


def part_8b_offload(args) -> dict:
    import torch

    from neutrain.nn.offload import offload_checkpointed_inputs
    from neutrain.nn.weight_offload_model import offload_weights
    from neutrain.memory import ModelShape, estimate

    config, model, opt, batch, seq, build_s = _build_8b(args)
    shape = ModelShape.from_config(config)
    budget = args.budget_gib * GIB
    fits = estimate(shape, batch=batch, seq=seq, weights="neuzip-lossless", optimizer="lomo",
                    offload_weights=True).reserved < 0.9 * budget
    store = offload_weights(model)
    if not fits:
        offload_checkpointed_inputs(model)
    est = estimate(shape, batch=batch, seq=seq, weights="neuzip-lossless", optimizer="lomo", offload_weights=True,
                   offload_activations=not fits)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
    try:
        offloaded = _steps(model, opt, config.vocab_size, batch, seq, args.steps, store)
    except torch.OutOfMemoryError as exc:
        offloaded = {"oom": True, "error": str(exc).splitlines()[0][:300]}
    offloaded.update(build_s=build_s, batch=batch, seq=seq, budget_gib=args.budget_gib, offload_activations=not fits,
                     sync_debug=store.sync_debug, planner_reserved_gib=round(est.reserved / GIB, 3),
                     planner_h2d_gib=round(est.settings["h2d_bytes_per_step"] / GIB, 3),
                     planner_d2h_gib=round(est.settings["d2h_bytes_per_step"] / GIB, 3))
    if "oom" not in offloaded and args.timeline:
        offloaded["timeline"] = timeline(model, opt, config.vocab_size, batch, seq, store)
    print("8b offloaded", {k: v for k, v in offloaded.items() if k != "timeline"}, flush=True)
    torch.cuda.set_per_process_memory_fraction(1.0)
    store.close()
    return offloaded


def part_70b(args) -> dict:
    import torch
    from transformers import LlamaConfig

    from neutrain.nn.load import build
    from neutrain.nn.model_spec import ModelSpec, Placement
    from neutrain.nn.sources import RandomInit
    from neutrain.nn.weight_offload_model import weight_store
    from neutrain.optim import LOMO
    from neutrain.memory import ModelShape, estimate

    cfg = dict(TINY_70B if args.tiny else LLAMA3_70B)
    if args.layers_70b:
        cfg["num_hidden_layers"] = args.layers_70b
    config = LlamaConfig(**cfg)
    config._attn_implementation = "sdpa"
    t0 = time.perf_counter()
    placement = Placement("neuzip-lossless", offload=True, device="cuda")
    model, _ = build(ModelSpec(RandomInit(), config, torch.bfloat16, placement=placement), progress=False)
    store = weight_store(model)
    build_s = time.perf_counter() - t0
    print(f"70b built in {build_s:.0f} s; pinned {store.pinned_bytes / GIB:.1f} GiB; "
          f"device {torch.cuda.memory_reserved() / GIB:.1f} GiB reserved", flush=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    opt = LOMO(model.parameters(), lr=1e-5, clip_mode="per_tensor", max_grad_norm=1.0).bind(model)
    seq = 128 if args.tiny else args.seq
    try:
        row = _steps(model, opt, config.vocab_size, 1, seq, args.steps, store)
    except torch.OutOfMemoryError as exc:
        row = {"oom": True, "error": str(exc).splitlines()[0][:300]}
    est = estimate(ModelShape.from_config(config), batch=1, seq=seq, weights="neuzip-lossless", optimizer="lomo",
                   offload_weights=True)
    row.update(layers=config.num_hidden_layers, seq=seq, build_s=round(build_s, 1),
               host_payload_gib=round(store.host_bytes / GIB, 3), planner_reserved_gib=round(est.reserved / GIB, 3),
               planner_h2d_gib=round(est.settings["h2d_bytes_per_step"] / GIB, 3),
               planner_d2h_gib=round(est.settings["d2h_bytes_per_step"] / GIB, 3))
    if "oom" not in row and args.timeline:
        row["timeline"] = timeline(model, opt, config.vocab_size, 1, seq, store)
    row["sync_debug"] = store.sync_debug
    print("70b", {k: v for k, v in row.items() if k != "timeline"}, flush=True)
    store.close()
    return row


def targets_of(results: dict, full_70b: bool) -> dict:
    t = {}
    b8 = results.get("8b") or {}
    if "tokens_per_s" in b8.get("offloaded", {}) and "tokens_per_s" in b8.get("in_gpu", {}) \
            and not b8["offloaded"].get("sync_debug"):
        ratio = b8["offloaded"]["tokens_per_s"] / b8["in_gpu"]["tokens_per_s"]
        t["offload_8b_over_in_gpu"] = {"value": round(ratio, 3), "goal": ">= 0.85", "met": ratio >= 0.85}
    b70 = results.get("70b")
    if b70 and "tokens_per_s" in b70 and full_70b and not b70.get("sync_debug"):
        t["h100_70b_tokens_per_s_16k"] = {"value": b70["tokens_per_s"], "goal": ">= 620", "met": b70["tokens_per_s"] >= 620}
        gib = b70["peak_reserved_gib"]
        t["h100_70b_peak_reserved_gib"] = {"value": round(gib, 2), "goal": "<= 70", "met": gib <= 70}
    return t


PARTS = {"link": lambda a: link_bandwidth(), "8b_gpu": part_8b_gpu, "8b_offload": part_8b_offload, "70b": part_70b}
ALIASES = {"8b": ("8b_gpu", "8b_offload")}


def store_part(results: dict, part: str, row: dict) -> None:
    """Put a part's record where the JSON (and :func:`targets_of`) expect it: the two 8B processes
    under ``results["8b"]`` as ``in_gpu`` and ``offloaded``."""
    if part in ("8b_gpu", "8b_offload"):
        results.setdefault("8b", {})["in_gpu" if part == "8b_gpu" else "offloaded"] = row
    else:
        results[part] = row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="link,8b,70b", help=f"comma-separated: {', '.join([*PARTS, *ALIASES])}")
    ap.add_argument("--steps", type=int, default=4, help="steps per measurement (the first is warm-up)")
    ap.add_argument("--budget-gib", type=float, default=8.0)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--layers-70b", type=int, default=0, help="fewer decoder layers (a reduced check; no targets)")
    ap.add_argument("--no-timeline", dest="timeline", action="store_false")
    ap.add_argument("--merge", action="store_true", help="keep the other parts of an existing offload.json")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--name", default=NAME)
    ap.add_argument("--part-timeout", type=float, default=None, help="seconds a part's process may run")
    ap.add_argument("--child", nargs=2, metavar=("PART", "RECORD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:  # one part in this process (started by the parent below): its record goes to RECORD
        from benchmarks._isolated import child

        part, record = args.child
        child(lambda: PARTS[part](args), record)

    import torch

    from benchmarks._common import git_provenance, read_record, write_result
    from benchmarks._isolated import run_part

    parts = [q for p in args.parts.split(",") if p for q in ALIASES.get(p, (p,))]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        print(f"benchmarks/offload/offload.py: unknown part {unknown[0]!r} (parts: {', '.join([*PARTS, *ALIASES])})",
              file=sys.stderr)
        return 2
    git_provenance()
    if not torch.cuda.is_available():
        print("benchmarks/offload/offload.py needs a CUDA GPU (the CPU path is covered by tests/unit/nn/test_weight_offload.py)")
        return 1
    results: dict = {}
    previous = read_record(args.name) if args.merge else None
    if previous is not None:
        results = previous.get("results", {})
    # The parent never touches CUDA beyond the check above: each part gets a fresh process and context.
    forwarded = list(sys.argv[1:])
    failed = []
    for part in parts:
        t0 = time.perf_counter()
        row = run_part(part, [sys.executable, str(Path(__file__).resolve()), *forwarded, "--child", part],
                       timeout=args.part_timeout)
        store_part(results, part, row)
        if "failed" in row:
            failed.append(part)
            print(f"{part} FAILED: {row['failed']}", flush=True)
        print(f"{part} done in {time.perf_counter() - t0:.0f} s", flush=True)
        full_70b = not args.tiny and not args.layers_70b and args.seq == 16384
        write_result(args.name, {"parts": parts, "steps": args.steps, "budget_gib": args.budget_gib,
                                 "seq_70b": args.seq, "layers_70b": args.layers_70b or None, "tiny": args.tiny,
                                 "optimizer": "lomo (fused, per-tensor clip 1.0)", "weights": "neuzip-lossless",
                                 "activation_checkpointing": True, "ahead": 2, "slots": 4,
                                 "process_per_part": True, "failed_parts": failed,
                                 "sync_debug": os.environ.get("NEUTRAIN_OFFLOAD_SYNC_DEBUG", ""),
                                 "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")},
                     results, targets=targets_of(results, full_70b),
                     targets_note=None if full_70b else "70B targets only from the full 80-layer run at 16K")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
