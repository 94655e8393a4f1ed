"""Where one training step's time goes, host against device: compressed (variant d) against dense (c).

Builds the variants as ``benchmarks/memory/train_memory.py`` does (Llama-3-8B shapes, sequence 1024, activation
checkpointing, fused LOMO, per-tensor clipping at 1.0), warms up, then for each variant and batch size:

* ``step_s``: the step's time by CUDA events, the median of ``--steps`` steps;
* ``host_issue_s``: how long the host takes to return from the step's Python (the device synchronised before,
  not after). When it is close to ``step_s`` the host sets the pace and the device waits on it;
* a profiled step (torch.profiler): device-busy time (the union of kernel intervals), the idle time between
  kernels and its longest gaps, kernel launches, the top kernels, the top host operations by their own time;
* a cProfile of one step: the Python functions with the most own time (what the host spends its time on).

Each variant runs in its own process so the allocator starts clean. The Chrome trace of each profiled step is
written gzipped beside the record (``--out``) for a look at the timeline.

    python benchmarks/memory/step_timeline.py --variants d,c --batches 1 --out /tmp/timeline   # on a GPU
    python benchmarks/memory/step_timeline.py --tiny --variants d,c --batches 1               # smoke test, CPU
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import io
import json
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _build(key: str, tiny: bool, device: str):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from benchmarks.memory.train_memory import LLAMA3_8B, TINY, VARIANTS

    weights, opt_name = VARIANTS[key]
    config = LlamaConfig(**(TINY if tiny else LLAMA3_8B))
    config._attn_implementation = "sdpa"
    if weights == "dense":
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    else:
        from neutrain.nn.load import init_compressed

        model, _ = init_compressed(config, weights, device, dtype=torch.bfloat16, progress=False)
        if key == "q":
            from neutrain.nn import PREFETCHER

            PREFETCHER.enabled = True
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    from neutrain.optim import optimizer_spec

    rule = optimizer_spec(opt_name).resolve()
    opt = rule(model.parameters(), lr=1e-4, clip_mode=os.environ.get("CLIP", "per_tensor"),
               max_grad_norm=1.0).bind(model)
    return model, opt, config


def _device_busy(prof) -> dict:
    """Union of kernel intervals in the profiled step, the idle between them, the largest gaps."""
    import torch

    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return {}
    from benchmarks.memory._timeline import busy_and_gaps

    span, busy, gaps = busy_and_gaps(spans)
    gaps.sort(reverse=True)
    return {"device_span_ms": round(span / 1e3, 2), "device_busy_ms": round(busy / 1e3, 2),
            "device_idle_ms": round(sum(gaps) / 1e3, 2), "gaps_over_50us": sum(g > 50 for g in gaps),
            "largest_gaps_ms": [round(g / 1e3, 3) for g in gaps[:10]], "kernels": len(spans)}


def _tables(prof, top: int = 25) -> dict:
    import torch

    kernels: dict[str, list[float]] = {}
    host: dict[str, list[float]] = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            continue
        host[e.key[:80]] = [e.self_cpu_time_total / 1e3, e.count]
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name[:90], [0.0, 0])
            k[0] += e.device_time / 1e3
            k[1] += 1
    rank = lambda d: [{"name": n, "ms": round(v[0], 2), "calls": v[1]}
                      for n, v in sorted(d.items(), key=lambda kv: -kv[1][0])[:top]]
    return {"top_kernels": rank(kernels), "top_host_self": rank(host)}


def phase_peaks(model, step) -> dict:
    """Peak allocated and reserved GiB of one step's phases: forward, the loss's backward (the lm_head), the
    decoder's backward, the embedding's update. Read from the allocator's host-side statistics at tensor hooks
    on the final norm's and the embedding's outputs, so nothing is synchronised inside the step."""
    import torch

    peaks: dict[str, dict] = {}
    gib = 2**30

    def mark(name):
        peaks[name] = {"allocated_gib": round(torch.cuda.max_memory_allocated() / gib, 3),
                       "reserved_gib": round(torch.cuda.max_memory_reserved() / gib, 3)}
        torch.cuda.reset_peak_memory_stats()

    def on_output(name):
        def forward_hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            if out.requires_grad:
                out.register_hook(lambda grad: mark(name))
        return forward_hook

    decoder = model.get_decoder()
    handles = [decoder.norm.register_forward_hook(on_output("loss_backward")),
               decoder.embed_tokens.register_forward_hook(on_output("decoder_backward"))]
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step(mark)
        mark("embedding_update")
    finally:
        for h in handles:
            h.remove()
    return peaks


def run_child(key: str, tiny: bool, batches: list[int], steps: int, out: Path) -> dict:
    import torch

    from neutrain.nn import causal_lm_loss

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    model, opt, config = _build(key, tiny, device)
    result = {"variant": key, "build_s": round(time.perf_counter() - t0, 1)}
    seq = 128 if tiny else 1024
    for batch in batches:
        ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)

        def step(after_forward=None):
            loss = causal_lm_loss(model, ids, ids)
            if after_forward is not None:
                after_forward("forward")
            opt.backward(loss)
            opt.step()
            return loss

        for _ in range(3):
            step()
        sync()
        times, issue = [], []
        for _ in range(steps):
            sync()
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            t = time.perf_counter()
            step()
            issue.append(time.perf_counter() - t)
            if cuda:
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            else:
                times.append(issue[-1])
        med = lambda xs: sorted(xs)[len(xs) // 2]
        row = {"step_s": round(med(times), 4), "host_issue_s": round(med(issue), 4),
               "tokens_per_s": round(batch * seq / med(times), 1), "step_times_s": [round(x, 4) for x in times]}
        from torch.profiler import ProfilerActivity, profile

        sync()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            step()
            sync()
        row.update(_device_busy(prof))
        row.update(_tables(prof))
        trace = out / f"trace_{key}_b{batch}.json"
        prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as f, gzip.open(str(trace) + ".gz", "wb") as g:
            g.write(f.read())
        trace.unlink()
        pr = cProfile.Profile()
        sync()
        pr.enable()
        step()
        sync()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(35)
        row["cprofile_tottime"] = s.getvalue().splitlines()[:60]
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45)
        row["cprofile_cumulative"] = s.getvalue().splitlines()[:70]
        if cuda:
            row["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
            row["phase_peaks"] = phase_peaks(model, step)
        result[f"batch{batch}"] = row
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="d,c")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default="/tmp/step_timeline")
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        res = run_child(args.child, args.tiny, batches, args.steps, out)
        (out / f"timeline_{args.child}.json").write_text(json.dumps(res, indent=1))
        return 0
    rows = {}
    variants = args.variants.split(",")
    for i, key in enumerate(variants):  # a variant listed twice (d,c,d,c) runs twice: rounds against host drift
        name = key if variants.count(key) == 1 else f"{key}{variants[:i].count(key) + 1}"
        cmd = [sys.executable, __file__, "--child", key, "--batches", args.batches, "--steps", str(args.steps),
               "--out", str(out)] + (["--tiny"] if args.tiny else [])
        try:
            rc = subprocess.run(cmd, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        f = out / f"timeline_{key}.json"
        rows[name] = json.loads(f.read_text()) if f.exists() else {"rc": rc}
        if f.exists():
            f.rename(out / f"timeline_{name}.json")
    (out / "timeline.json").write_text(json.dumps(rows, indent=1))
    print(f"{'variant':8} {'batch':>5} {'step ms':>8} {'issue ms':>8} {'busy ms':>8} {'idle ms':>8} {'kernels':>7} "
          f"{'resv GiB':>8}  phase peaks (allocated GiB)")
    for key, r in rows.items():
        for b in batches:
            x = r.get(f"batch{b}", {})
            phases = " ".join(f"{n}={v['allocated_gib']}" for n, v in x.get("phase_peaks", {}).items())
            print(f"{key:8} {b:5} {x.get('step_s', 0) * 1e3:8.1f} {x.get('host_issue_s', 0) * 1e3:8.1f} "
                  f"{x.get('device_busy_ms', 0):8.1f} {x.get('device_idle_ms', 0):8.1f} {x.get('kernels', 0):7} "
                  f"{x.get('peak_reserved_gib', 0):8.2f}  {phases}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
