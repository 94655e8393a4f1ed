"""SageAttention (INT8 QK, FP8 PV) against torch SDPA's cuDNN and flash backends: same process, same card.

Steps, all in one run (one device call):

1. Backward routes: torch's private cuDNN and flash SDPA backward kernels, fed an O and
   natural-log LSE, must reproduce autograd's gradients (GQA too) before they are timed.
2. Forward autotune of the Triton kernel at 8K (d=128): block/warps/stages, the hand-pipelined
   loop, one K scale per tile; each candidate must pass the fidelity gate against fp32.
3. Sweep over N (``--sizes``, default 8K, 16K, 4K, 1K, 256, 32K in that order), causal and not,
   B=4, H=32, d=128, for each Sage forward kernel: Triton's and, on Hopper with the Triton release
   it is written for, the warp-specialized Gluon one (elsewhere its rows say why it was skipped).
   Each kernel alone, then ``sage_attention`` on it (quantization included) forward and
   forward+backward with each backward route (``--routes``), and SDPA's cuDNN and flash.
   Median of CUDA-event timings after warm-up; peak memory. Results and table are written after
   every length, so a run cut off by its timeout keeps what it measured.
4. The dispatch table (``neutrain/attention/dispatch_table.json``): per (device, d, causal,
   mode) the faster Sage kernel (``"kernel"``), and sage only where it was measured faster than
   cuDNN by the margin (``benchmarks/attention/_attention_table.py``), plus the autotuned Triton config.
5. Optionally (``--train-step``) the Llama-3-8B training step, sage vs cuDNN SDPA
   (``benchmarks/attention/attention_train_step.py``), for ``train_step_over_sdpa``; or, after a
   separate step run, ``--fold-train-step FILE`` puts its record in and recomputes the targets.

FLOPs: forward 4*B*H*d*N^2 (halved causal), forward+backward 3.5x that (SageAttention's bench).

    PYTHONPATH=. python benchmarks/attention/attention.py --train-step
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.attention._attention_fidelity import route_fidelity  # noqa: E402
from benchmarks.attention._attention_table import (KERNELS, auto_step_summary, build_table, method_name, targets,  # noqa: E402
                              train_step_choice)
from benchmarks._common import cuda_time_ms, write_result  # noqa: E402

from neutrain.attention import dispatch, exact_attention, sage_attention  # noqa: E402
from neutrain.attention.quant import TILE, quantize_attention_inputs  # noqa: E402
from neutrain.attention.reference import accuracy_metrics  # noqa: E402
from neutrain.attention.sage import exact_backward  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ROUTES = ("cudnn", "flash")


def attention_flops(b, h, n, d, causal, backward=False):
    flops = 4.0 * b * h * d * n * n / (2 if causal else 1)
    return flops * 3.5 if backward else flops


def _sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def fn(q, k, v, causal):
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return fn


def validate_routes(d=128):
    """Gradients of compat.sdpa_backward vs autograd, per route, plain and GQA; returns {route: report}."""
    report = {}
    gen = torch.Generator(device="cuda").manual_seed(1)
    for route in ROUTES:
        rows = []
        for hq, hk, causal in ((8, 8, False), (8, 8, True), (8, 2, True)):
            q = torch.randn(2, hq, 1000, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            k, v = (torch.randn(2, hk, 1000, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            g = hq // hk
            out = F.scaled_dot_product_attention(qg, kg.repeat_interleave(g, 1), vg.repeat_interleave(g, 1),
                                                 is_causal=causal)
            grad = torch.randn_like(out)
            out.backward(grad)
            s = (q.float() @ k.float().repeat_interleave(g, 1).transpose(-1, -2)) * d ** -0.5
            if causal:
                s = s.masked_fill(~torch.ones(1000, 1000, dtype=torch.bool, device="cuda").tril(), float("-inf"))
            lse = torch.logsumexp(s, -1)
            row = {"hq": hq, "hk": hk, "causal": causal}
            try:
                dq, dk, dv = exact_backward(route, grad, q, k, v, out.detach(), lse, causal, d ** -0.5)
                row["cos"] = [accuracy_metrics(a, b.grad)["cos"] for a, b in zip((dq, dk, dv), (qg, kg, vg))]
                row["ok"] = all(c > 0.9999 for c in row["cos"])
            except Exception as exc:  # a route torch cannot run here is reported, not used
                row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:200]}")
            rows.append(row)
        report[route] = {"ok": all(r["ok"] for r in rows), "cases": rows}
        print("route", route, report[route], flush=True)
    return report


def autotune_forward(b, h, d, n, candidates):
    """{causal: {config: ms}} of the forward kernel at one size; a candidate that fails or disagrees is dropped."""
    from neutrain.kernels import sage_attention as kernels

    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    out = {}
    for causal in (False, True):
        times = {}
        exact = exact_attention(q[:1, :2], k[:1, :2], v[:1, :2], causal)
        for cfg in candidates:
            qi = quantize_attention_inputs(q, k, v, d ** -0.5, k_group=TILE if cfg["k_tile_scale"] else 16)
            launch = kernels.ForwardConfig(cfg["block_m"], cfg["num_warps"], cfg["num_stages"], cfg["pipeline"])
            key = json.dumps(cfg, sort_keys=True)
            try:
                o, _ = kernels.sage_attention_forward(qi, causal, config=launch)
                acc = accuracy_metrics(o[:1, :2], exact)
                if not (acc["cos"] >= 0.999 and acc["rel_l1"] <= 0.03):  # the fidelity gate, per candidate
                    print(f"config {key} misses the fidelity gate vs fp32 ({acc}): dropped")
                    continue
                times[key] = cuda_time_ms(lambda: kernels.sage_attention_forward(qi, causal, config=launch),
                                          warmup=3, iters=15)
                print(f"causal={causal} {key}: {times[key]:.3f} ms", flush=True)
            except Exception as exc:  # a config can exceed shared memory or registers
                print(f"config {key} failed: {type(exc).__name__}: {str(exc)[:160]}")
            del qi
        out[causal] = times
    return out


def sass_profile(config, d=128, causal=False):
    """Instruction counts and resource use of the compiled forward (the kernel the table ships)."""
    from neutrain.kernels import sage_attention as kernels

    x = torch.randn(1, 1, 4 * TILE, d, device="cuda", dtype=torch.bfloat16)
    qi = quantize_attention_inputs(x, x, x, d ** -0.5, k_group=TILE if config["k_tile_scale"] else 16)
    kernels.sage_attention_forward(qi, causal, config=kernels.ForwardConfig(
        config["block_m"], config["num_warps"], config["num_stages"], config["pipeline"]))
    compiled = kernels._LAST_LAUNCH["forward"]
    try:
        sass = compiled.asm["sass"]
    except Exception:
        return {"error": "no SASS"}
    lines = sass.splitlines()
    ops = ("IGMMA", "QGMMA", "HGMMA", "MUFU.EX2", "FMUL", "FFMA", "FADD", "FMNMX", "F2FP", "I2F", "LDL", "STL", "BAR.SYNC")
    prof = {op: sum(op in ln for ln in lines) for op in ops}
    for attr in ("n_regs", "n_spills"):
        prof[attr] = getattr(compiled, attr, None)
    prof["shared_bytes"] = getattr(getattr(compiled, "metadata", None), "shared", None)
    return prof


def gluon_unavailable_reason() -> str | None:
    """Why the Gluon forward cannot run on this device at all (None when it can: Hopper, and a Triton release
    the kernel is written for)."""
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"capability {major}.{minor} is not Hopper (9.x)"
    try:
        import triton
        from neutrain.kernels.sage_attention_gluon import GLUON_TRITON_VERSIONS, gluon_available
    except ImportError as exc:
        return f"this Triton has no Gluon ({exc})"
    if not gluon_available():
        return f"Triton {triton.__version__} is not a release the Gluon kernel is written for {GLUON_TRITON_VERSIONS}"
    return None


def gluon_skip_reason(qi) -> str | None:
    """Why the Gluon forward cannot take this call here (None when it runs): dispatch would run Triton's."""
    from neutrain.attention.sage import gluon_runs

    if gluon_runs(qi, None):
        return None
    return gluon_unavailable_reason() or "the Gluon kernel does not compute this call (gluon_supports)"


def _kernel_row(n, causal, method, fn, warm, iters, flops):
    try:
        ms = cuda_time_ms(fn, warm, iters)
    except Exception as exc:  # a kernel that fails here is recorded and the sweep goes on
        return {"n": n, "causal": causal, "method": method, "skipped": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return {"n": n, "causal": causal, "method": method, "fwd_ms": ms, "fwd_tops": flops / ms / 1e9}


def time_point(b, h, d, n, causal, config, routes, baselines, gen, accuracy_max_n, iters):
    """All methods at one (N, causal): each Sage forward kernel alone, then ``sage_attention`` on each kernel
    (Triton's ``sage+<route>``, Gluon's ``gluon+<route>``) with each backward route, and SDPA's backends:
    forward and forward+backward rows. A kernel that cannot run here gets a row saying why."""
    from neutrain.kernels import sage_attention as kernels

    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    grad = torch.randn_like(q)
    warm = 2 if n >= 32768 else 3
    exact = exact_attention(q[:1, :4], k[:1, :4], v[:1, :4], causal) if n <= accuracy_max_n else None
    rows = []
    fwd_flops, fb_flops = attention_flops(b, h, n, d, causal), attention_flops(b, h, n, d, causal, True)
    qi = quantize_attention_inputs(q, k, v, d ** -0.5, k_group=TILE if config["k_tile_scale"] else 16)
    launch = kernels.ForwardConfig(config["block_m"], config["num_warps"], config["num_stages"], config["pipeline"])
    quant_ms = cuda_time_ms(lambda: quantize_attention_inputs(q, k, v, d ** -0.5, k_group=qi.k_group), warm, iters)
    rows.append({**_kernel_row(n, causal, "sage_kernel", lambda: kernels.sage_attention_forward(qi, causal, config=launch),
                               warm, iters, fwd_flops), "quant_ms": quant_ms})
    gluon_skip = gluon_skip_reason(qi)
    if gluon_skip is None:
        from neutrain.kernels.sage_attention_gluon import sage_attention_forward_gluon

        # The default GluonConfig: the one sage_attention(backend="gluon"), and so dispatch, launches.
        rows.append({**_kernel_row(n, causal, "gluon_kernel", lambda: sage_attention_forward_gluon(qi, causal),
                                   warm, iters, fwd_flops), "quant_ms": quant_ms})
    else:
        rows.append({"n": n, "causal": causal, "method": "gluon_kernel", "skipped": gluon_skip})
    del qi
    methods = {}
    for kernel in KERNELS:
        if kernel == "gluon" and gluon_skip is not None:
            rows += [{"n": n, "causal": causal, "method": method_name(kernel, r), "kernel": kernel, "backward": r,
                      "skipped": gluon_skip} for r in routes]
            continue
        for r in routes:
            methods[method_name(kernel, r)] = (kernel, r, lambda q_, k_, v_, c, r=r, kernel=kernel: sage_attention(
                q_, k_, v_, causal=c, backward=r, config=config, backend=kernel))
    for backend in baselines:
        methods[f"sdpa_{backend}"] = (None, None, _sdpa(backend))
    fwd_done = {}
    for name, (kernel, route, fn) in methods.items():
        row = {"n": n, "causal": causal, "method": name}
        if kernel is not None:
            row.update(kernel=kernel, backward=route)
        fwd_key = kernel or name  # one kernel's forward is the same whatever the backward route
        try:
            if fwd_key not in fwd_done:
                with torch.no_grad():
                    out = fn(q, k, v, causal)
                    if exact is not None:
                        row.update({f"acc_{key}": val for key, val in accuracy_metrics(out[:1, :4], exact).items()})
                    del out
                    fwd_done[fwd_key] = cuda_time_ms(lambda: fn(q, k, v, causal), warm, iters)
            row["fwd_ms"] = fwd_done[fwd_key]
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

            def fwd_bwd():
                qg.grad = kg.grad = vg.grad = None
                fn(qg, kg, vg, causal).backward(grad)

            fwd_bwd()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            row["fwd_bwd_ms"] = cuda_time_ms(fwd_bwd, warm, iters)
            row["fwd_bwd_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            row["fwd_tops"] = fwd_flops / row["fwd_ms"] / 1e9
            row["fwd_bwd_tops"] = fb_flops / row["fwd_bwd_ms"] / 1e9
            del qg, kg, vg
        except Exception as exc:  # recorded, never compared; the other methods still run
            row["skipped"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        torch.cuda.empty_cache()
        rows.append(row)
        print({k_: (round(v_, 4) if isinstance(v_, float) else v_) for k_, v_ in row.items()}, flush=True)
    return rows


def read_table(path) -> dict:
    """The table file's contents ({} when missing or unreadable)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def merged_table(path, device, d, config, entries, margin, tuned=True, old=None):
    """The table file with this run's measurements merged in.

    Earlier entries of the same (device, head dim) whose lengths overlap this run's measured
    range are replaced; other devices, head dims and lengths stay, so short and long sequences
    can be measured in separate runs. The kernel config is replaced only by an autotuned one.
    """
    old = read_table(path) if old is None else old
    lo = min((e["seq_min"] for e in entries), default=0)
    hi = max((e["seq_max"] for e in entries), default=-1)
    kept = [e for e in old.get("entries", [])
            if (e.get("device"), e.get("head_dim")) != (device, d) or e["seq_max"] < lo or e["seq_min"] > hi]
    configs = old.get("kernel_configs", {})
    if tuned or str(d) not in configs.get(device, {}):
        configs.setdefault(device, {})[str(d)] = config
    return {"version": 1, "generated_by": "benchmarks/attention/attention.py", "margin": margin,
            "kernel_configs": configs, "entries": kept + entries}


def _write(args, device, d, rows, routes_report, tune, config, profile, train_step, base_table=None, fidelity=None):
    """Write the dispatch table and the record's row in benchmarks/attention/results.jsonl from the rows so far; return the results.

    Called after every length of the sweep (a run cut off by its timeout keeps what it measured) and
    again with the training step. ``base_table`` is the table file as it was before this run, so each
    write merges this run's entries into the same starting point.
    """
    train_routes = (fidelity or {}).get("admissible_train_routes")
    entries, left_out = build_table(device, d, rows, args.margin, train_routes)
    picked = [e for e in entries if e["backend"] == "sage"]
    proof = all(all(ev["speedup"] >= args.margin for ev in e["evidence"]) for e in picked)
    if args.table:
        table = merged_table(args.table, device, d, config, entries, args.margin, tuned=not args.no_autotune,
                             old=base_table)
        tmp = Path(args.table).with_suffix(".json.tmp")  # replaced whole: a timeout mid-write leaves the old table
        tmp.write_text(json.dumps(table, indent=1) + "\n")
        os.replace(tmp, args.table)
    settings = {"batch": args.batch, "heads": args.heads, "head_dim": d, "sizes": args.sizes, "iters": args.iters,
                "routes": args.routes, "baselines": args.baselines,
                "flops": "fwd 4*B*H*d*N^2 (/2 causal); fwd+bwd 3.5x fwd",
                "timing": "median of CUDA-event timings after warm-up",
                "accuracy": f"batch 0, heads 0-3 vs exact fp32 attention, N <= {args.accuracy_max_n}",
                "kernels": "Sage forward on Triton (the autotuned ForwardConfig) and on Gluon (its default GluonConfig, "
                           "what backend='gluon' launches), each followed by every backward route"}
    tg = targets(rows, train_step, entries, d)
    gluon_skips = sorted({r["skipped"] for r in rows if r["method"] == "gluon_kernel" and r.get("skipped")})
    measured = sorted({r["n"] for r in rows})
    results = {"targets": tg, "rows": rows, "measured_n": measured, "backward_routes": routes_report,
               "gluon": {"runs": not gluon_skips, "skipped_because": gluon_skips},
               "autotune_8k_ms": {str(k): v for k, v in tune.items()}, "forward_config": config,
               "sass_profile": profile, "dispatch_entries": entries, "kernels_left_out_of_table": left_out,
               "dispatch_picks_sage": [f"d={e['head_dim']} causal={e['causal']} {e['mode']} N={e['seq_min']}-{e['seq_max']}"
                                       f" kernel={e['kernel']}" for e in picked],
               "dispatch_kernels": {k: sum(e["kernel"] == k for e in entries) for k in KERNELS},
               "dispatch_proof_every_sage_pick_measured_faster": proof,
               "route_fidelity": fidelity, "train_step_choice": train_step_choice(rows, train_routes),
               "train_step": train_step,
               "headline": f"d={d}: " + ", ".join(f"{k} {v['value']} (goal {v['goal']})" for k, v in tg.items()
                                                  if v["value"] is not None)
               + f"; dispatch picks sage for {len(picked)} of {len(entries)} measured shapes"}
    print("wrote", write_result(args.name, settings, results, targets=tg), flush=True)
    return results


def fold_train_step(name: str, train_step_path: str, table: str) -> dict:
    """Put a training-step record (``attention_train_step.py --out``) into ``<name>.json`` and recompute its
    targets: the device script runs the step after the sweep, in its own process and timeout."""
    record = records.current(name)
    results, settings = record["results"], record["settings"]
    path = Path(train_step_path)
    train_step = json.loads(path.read_text()) if path.exists() else {"failed": True, "missing": str(path)}
    results["train_step"] = train_step
    results["targets"] = targets(results["rows"], train_step, results["dispatch_entries"], settings["head_dim"])
    results["headline"] = (f"d={settings['head_dim']}: " + ", ".join(
        f"{k} {v['value']} (goal {v['goal']})" for k, v in results["targets"].items() if v["value"] is not None)
        + results["headline"][results["headline"].rfind(";"):])
    print("wrote", write_result(name, settings, results, targets=results["targets"], measured_on=record), flush=True)
    return results


def fold_auto_step(name: str, paths: list[str]) -> dict:
    """Put ``attention_train_step.py --variants auto,sdpa`` records (one per model) into ``<name>.json``
    (``results["auto_train_step"]`` and ``auto_over_sdpa_min``: :func:`auto_step_summary`). Like
    :func:`fold_train_step`, the record keeps the sweep's device, versions and date (``measured_on``), so a
    fold made on another machine says where it was assembled."""
    record = records.current(name)
    results, settings = record["results"], record["settings"]
    # The record's git_commit becomes the auto step's (this fold's); the sweep's commit is kept beside it.
    results.setdefault("sweep_git_commit", record.get("git_commit"))
    results.update(auto_step_summary([json.loads(Path(p).read_text()) for p in paths],
                                     results.get("auto_train_step", {})))
    print("wrote", write_result(name, settings, results, targets=results["targets"], measured_on=record), flush=True)
    return results


# (BLOCK_M, warps, stages, hand-pipelined loop, one K scale per tile). BLOCK_M 64 with 4 warps
# and 2 stages fits two CTAs per SM (~104 KB shared memory, <= 255 registers each): two
# independent warpgroups whose MMA and softmax phases can interleave without a shared barrier.
CANDIDATES = [dict(block_m=m, num_warps=w, num_stages=s, pipeline=p, k_tile_scale=t)
              for (m, w, s, p, t) in ((128, 8, 3, False, False), (128, 8, 3, False, True), (128, 8, 3, True, False),
                                      (128, 8, 4, False, True), (64, 4, 2, False, True), (64, 4, 3, False, True))]


#: Default sweep: the long lengths the targets read first, short ones for the table's ranges, 32K (the
#: dearest: ~40% of the sweep's time) last; every length is written as soon as it is measured.
DEFAULT_SIZES = "8192,16384,4096,1024,256,32768"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="sequence lengths, measured in this order")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--accuracy-max-n", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=10, help="timed repetitions (halved at 32K)")
    parser.add_argument("--margin", type=float, default=1.02, help="sage must be this much faster to be picked")
    parser.add_argument("--routes", default=",".join(("triton", *ROUTES)),
                        help="backward routes timed after each Sage forward (cudnn/flash only where validated)")
    parser.add_argument("--baselines", default="cudnn,flash", help="SDPA backends timed (cudnn is the table's rival)")
    parser.add_argument("--no-autotune", action="store_true")
    parser.add_argument("--train-step", action="store_true", help="also time the 8B training step (8K, 16K)")
    parser.add_argument("--train-steps", type=int, default=5)
    parser.add_argument("--fold-train-step", metavar="JSON",
                        help="only put this attention_train_step.py record into <name>.json and recompute its targets")
    parser.add_argument("--fold-auto-step", metavar="JSON", nargs="+",
                        help="only put these attention_train_step.py --variants auto,sdpa records into <name>.json")
    parser.add_argument("--table", default=str(dispatch.TABLE_PATH), help="dispatch table to write ('' = none)")
    parser.add_argument("--name", default="attention")
    args = parser.parse_args()
    if args.fold_auto_step:
        results = fold_auto_step(args.name, args.fold_auto_step)
        print("auto over sdpa:", {m: v["auto_over_sdpa"] for m, v in results["auto_train_step"].items()},
              "min", results["auto_over_sdpa_min"])
        return
    if args.fold_train_step:
        tg = fold_train_step(args.name, args.fold_train_step, args.table)["targets"]
        print("targets:", json.dumps(tg)[:2000])
        return
    if "cudnn" not in args.baselines.split(","):
        parser.error("--baselines must include cudnn: the table and the targets compare against it")
    b, h, d = args.batch, args.heads, args.head_dim
    device = torch.cuda.get_device_name(0)
    start = time.time()
    base_table = read_table(args.table) if args.table else {}
    routes_report = validate_routes(d)
    routes = tuple(r for r in args.routes.split(",") if r == "triton" or routes_report.get(r, {}).get("ok"))
    baselines = tuple(args.baselines.split(","))
    # Which backward routes may train: each (kernel, route) on a real model's layer against fp32 (seconds).
    fidelity_kernels = ["triton"] + (["gluon"] if gluon_unavailable_reason() is None else [])
    fidelity = route_fidelity("cuda", fidelity_kernels, list(routes))
    print("route fidelity (real activations):", {r: {k: (p.get("fwd_cos"), p.get("grad_cos"), p["passes"])
                                                     for k, p in ks.items()} for r, ks in fidelity["by_route"].items()},
          "-> train routes", fidelity["admissible_train_routes"], flush=True)
    tune = {}
    if args.no_autotune:  # the shipped (autotuned) config for this card and head dim, else the default
        config = dispatch.kernel_config(device, d) or CANDIDATES[0]
    else:
        tune = autotune_forward(b, h, d, 8192, CANDIDATES)
        # One config for both mask modes: the smallest summed time over the ones both ran.
        common = set(tune[False]) & set(tune[True])
        config = json.loads(min(common, key=lambda c: tune[False][c] + tune[True][c]))
    print("forward config:", config, f"({time.time() - start:.0f} s)", flush=True)
    profile = sass_profile(config, d)
    print("SASS profile:", profile, flush=True)
    # Every candidate's resource use too (compiled already by the autotune, so cheap): why a variant lost.
    profile = {"chosen": profile, "candidates": {json.dumps(c, sort_keys=True): sass_profile(c, d) for c in CANDIDATES}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    common = dict(args=args, device=device, d=d, rows=rows, routes_report=routes_report, tune=tune, config=config,
                  profile=profile, base_table=base_table, fidelity=fidelity)
    for n in [int(s) for s in args.sizes.split(",")]:
        iters = max(3, args.iters // 2) if n >= 32768 else args.iters  # 32K: ~0.1-1.2 s per call
        for causal in (False, True):
            rows += time_point(b, h, d, n, causal, config, routes, baselines, gen, args.accuracy_max_n, iters)
        torch.cuda.empty_cache()
        print(f"N={n} done ({time.time() - start:.0f} s)", flush=True)
        results = _write(**common, train_step=None)  # a run cut off by its timeout keeps every length so far
    if args.train_step:
        choice = results["train_step_choice"]
        out = Path("/tmp/attention_train_step.json")
        subprocess.run([sys.executable, str(Path(__file__).with_name("attention_train_step.py")), "--seqs", "8192,16384",
                        "--steps", str(args.train_steps), "--backward", choice["backward"], "--kernel",
                        choice["kernel"], "--out", str(out), "--timeout", "150"], check=False)
        train_step = json.loads(out.read_text()) if out.exists() else {"failed": True}
        results = _write(**common, train_step=train_step)
    tg = results["targets"]
    print(f"{'N':>6} {'causal':>6} {'method':>12} {'fwd ms':>8} {'fwd TOPS':>8} {'f+b ms':>8} {'f+b TOPS':>8} {'cos':>8} {'relL1':>7}")
    for r in rows:
        if r.get("skipped"):
            print(f"{r['n']:>6} {str(r['causal']):>6} {r['method']:>12} skipped: {r['skipped'][:100]}")
            continue
        print(f"{r['n']:>6} {str(r['causal']):>6} {r['method']:>12} {r['fwd_ms']:8.2f} {r.get('fwd_tops', 0):8.0f} "
              f"{r.get('fwd_bwd_ms', 0):8.2f} {r.get('fwd_bwd_tops', 0):8.0f} {r.get('acc_cos', float('nan')):8.5f} "
              f"{r.get('acc_rel_l1', float('nan')):7.4f}")
    print("targets:", {k: (v["value"], v["goal"]) for k, v in tg.items()}, "| sage picked for:",
          results["dispatch_picks_sage"] or "nothing", "| kernels named:", results["dispatch_kernels"],
          "| proof:", results["dispatch_proof_every_sage_pick_measured_faster"])


if __name__ == "__main__":
    main()
