"""SageAttention (INT8 QK, FP8 PV) against torch SDPA's cuDNN and flash backends: same process, same card.

Steps, all in one run (one device call):

1. Backward routes: torch's private cuDNN and flash SDPA backward kernels, fed an O and
   natural-log LSE, must reproduce autograd's gradients (GQA too) before they are timed.
2. Forward autotune at 8K (d=128): block/warps/stages, the hand-pipelined loop, one K scale
   per tile; each candidate must match the default kernel's output.
3. Sweep over N (default 8K, 16K, 32K), causal and not, B=4, H=32, d=128: forward (with
   quantization, and the kernel alone) and forward+backward for sage with each backward
   route, cuDNN and flash. Median of CUDA-event timings after warm-up; peak memory.
4. The dispatch table (``neutrain/attention/dispatch_table.json``): per (device, d, causal,
   mode) sage only where it was measured faster than cuDNN, plus the autotuned kernel config.
5. Optionally (``--train-step``) the Llama-3-8B training step, sage vs cuDNN SDPA
   (``benchmarks/attention_train_step.py``), for ``train_step_over_sdpa``.

FLOPs: forward 4*B*H*d*N^2 (halved causal), forward+backward 3.5x that (SageAttention's bench).

    PYTHONPATH=. python benchmarks/attention.py --train-step
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cuda_time_ms, write_result  # noqa: E402

from neutrain.attention import dispatch, exact_attention, sage_attention  # noqa: E402
from neutrain.attention.quant import TILE, quantize_attention_inputs  # noqa: E402
from neutrain.attention.reference import accuracy_metrics  # noqa: E402
from neutrain.attention.sage import exact_backward  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
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


def time_point(b, h, d, n, causal, config, routes, gen, accuracy_max_n, iters):
    """All methods at one (N, causal): forward and forward+backward rows."""
    from neutrain.kernels import sage_attention as kernels

    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    grad = torch.randn_like(q)
    warm = 2 if n >= 32768 else 3
    exact = exact_attention(q[:1, :4], k[:1, :4], v[:1, :4], causal) if n <= accuracy_max_n else None
    rows = []
    fwd_flops, fb_flops = attention_flops(b, h, n, d, causal), attention_flops(b, h, n, d, causal, True)
    qi = quantize_attention_inputs(q, k, v, d ** -0.5, k_group=TILE if config["k_tile_scale"] else 16)
    launch = kernels.ForwardConfig(config["block_m"], config["num_warps"], config["num_stages"], config["pipeline"])
    kernel_ms = cuda_time_ms(lambda: kernels.sage_attention_forward(qi, causal, config=launch), warm, iters)
    quant_ms = cuda_time_ms(lambda: quantize_attention_inputs(q, k, v, d ** -0.5, k_group=qi.k_group), warm, iters)
    del qi
    rows.append({"n": n, "causal": causal, "method": "sage_kernel", "fwd_ms": kernel_ms,
                 "fwd_tops": fwd_flops / kernel_ms / 1e9, "quant_ms": quant_ms})
    methods = {f"sage+{r}": (lambda q_, k_, v_, c, r=r: sage_attention(q_, k_, v_, causal=c, backward=r, config=config))
               for r in ("triton", *routes)}
    methods["sdpa_cudnn"], methods["sdpa_flash"] = _sdpa("cudnn"), _sdpa("flash")
    fwd_done = {}
    for name, fn in methods.items():
        row = {"n": n, "causal": causal, "method": name}
        fwd_key = "sage" if name.startswith("sage") else name
        if fwd_key not in fwd_done:  # the sage forward is the same whatever the backward route
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
        torch.cuda.empty_cache()
        rows.append(row)
        print({k_: (round(v_, 4) if isinstance(v_, float) else v_) for k_, v_ in row.items()}, flush=True)
    return rows


def build_table(device, d, rows, routes, margin):
    """Dispatch entries from the sweep rows: forward = sage (quantization included) vs cuDNN forward;
    train = the fastest sage forward+backward route vs cuDNN forward+backward."""
    entries = []
    for causal in (False, True):
        by_n: dict[int, dict] = {}
        for r in rows:
            if r["causal"] == causal:
                by_n.setdefault(r["n"], {})[r["method"]] = r
        fwd_pts, train_pts = [], []
        for n, m in sorted(by_n.items()):
            if "sdpa_cudnn" not in m:
                continue
            fwd_pts.append({"n": n, "sage_ms": m["sage+triton"]["fwd_ms"], "sdpa_ms": m["sdpa_cudnn"]["fwd_ms"]})
            best = min((f"sage+{r}" for r in ("triton", *routes) if f"sage+{r}" in m), key=lambda k: m[k]["fwd_bwd_ms"])
            train_pts.append({"n": n, "sage_ms": m[best]["fwd_bwd_ms"], "sdpa_ms": m["sdpa_cudnn"]["fwd_bwd_ms"],
                              "backward": best.split("+")[1]})
        entries += dispatch.build_entries(device, d, causal, "bfloat16", "forward", fwd_pts, margin)
        entries += dispatch.build_entries(device, d, causal, "bfloat16", "train", train_pts, margin)
    return entries


def targets(rows, train_step):
    """The issue's three ratios: minimum over the sweep's (N, causal) of cuDNN time / sage time."""
    fwd, fb = [], []
    by = {}
    for r in rows:
        by.setdefault((r["n"], r["causal"]), {})[r["method"]] = r
    for m in by.values():
        if "sdpa_cudnn" not in m:
            continue
        fwd.append(m["sdpa_cudnn"]["fwd_ms"] / m["sage+triton"]["fwd_ms"])
        fb.append(m["sdpa_cudnn"]["fwd_bwd_ms"] / min(v["fwd_bwd_ms"] for k, v in m.items() if k.startswith("sage+")))
    step = (train_step or {}).get("speedup_vs_cudnn", {}).get("16384")
    return {"fwd_over_cudnn_min": {"value": round(min(fwd), 4) if fwd else None, "goal": 1.3},
            "fwd_bwd_over_cudnn_min": {"value": round(min(fb), 4) if fb else None, "goal": 1.05},
            "train_step_over_sdpa": {"value": round(step, 4) if step else None, "goal": 1.03}}


def merged_table(path, device, d, config, entries, margin, tuned=True):
    """The table file with this run's measurements merged in.

    Earlier entries of the same (device, head dim) whose lengths overlap this run's measured
    range are replaced; other devices, head dims and lengths stay, so short and long sequences
    can be measured in separate runs. The kernel config is replaced only by an autotuned one.
    """
    try:
        old = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        old = {}
    lo = min((e["seq_min"] for e in entries), default=0)
    hi = max((e["seq_max"] for e in entries), default=-1)
    kept = [e for e in old.get("entries", [])
            if (e.get("device"), e.get("head_dim")) != (device, d) or e["seq_max"] < lo or e["seq_min"] > hi]
    configs = old.get("kernel_configs", {})
    if tuned or str(d) not in configs.get(device, {}):
        configs.setdefault(device, {})[str(d)] = config
    return {"version": 1, "generated_by": "benchmarks/attention.py", "margin": margin,
            "kernel_configs": configs, "entries": kept + entries}


def _write(args, device, d, rows, routes_report, tune, config, profile, entries, train_step):
    """Write the dispatch table and benchmarks/results/<name>.json; return the results object."""
    picked = [e for e in entries if e["backend"] == "sage"]
    proof = all(all(ev["speedup"] >= args.margin for ev in e["evidence"]) for e in picked)
    if args.table:
        table = merged_table(args.table, device, d, config, entries, args.margin, tuned=not args.no_autotune)
        Path(args.table).write_text(json.dumps(table, indent=1) + "\n")
    settings = {"batch": args.batch, "heads": args.heads, "head_dim": d, "sizes": args.sizes, "iters": args.iters,
                "flops": "fwd 4*B*H*d*N^2 (/2 causal); fwd+bwd 3.5x fwd",
                "timing": "median of CUDA-event timings after warm-up",
                "accuracy": f"batch 0, heads 0-3 vs exact fp32 attention, N <= {args.accuracy_max_n}"}
    tg = targets(rows, train_step)
    results = {"targets": tg, "rows": rows, "backward_routes": routes_report,
               "autotune_8k_ms": {str(k): v for k, v in tune.items()}, "forward_config": config,
               "sass_profile": profile, "dispatch_entries": entries,
               "dispatch_picks_sage": [f"d={e['head_dim']} causal={e['causal']} {e['mode']} N={e['seq_min']}-{e['seq_max']}"
                                       for e in picked],
               "dispatch_proof_every_sage_pick_measured_faster": proof, "train_step": train_step,
               "headline": f"d={d}: " + ", ".join(f"{k} {v['value']} (goal {v['goal']})" for k, v in tg.items()
                                                  if v["value"] is not None)
               + f"; dispatch picks sage for {len(picked)} of {len(entries)} measured shapes"}
    print("wrote", write_result(args.name, settings, results), flush=True)
    return results


# (BLOCK_M, warps, stages, hand-pipelined loop, one K scale per tile). BLOCK_M 64 with 4 warps
# and 2 stages fits two CTAs per SM (~104 KB shared memory, <= 255 registers each): two
# independent warpgroups whose MMA and softmax phases can interleave without a shared barrier.
CANDIDATES = [dict(block_m=m, num_warps=w, num_stages=s, pipeline=p, k_tile_scale=t)
              for (m, w, s, p, t) in ((128, 8, 3, False, False), (128, 8, 3, False, True), (128, 8, 3, True, False),
                                      (128, 8, 4, False, True), (64, 4, 2, False, True), (64, 4, 3, False, True))]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="8192,16384,32768")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--accuracy-max-n", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=10, help="timed repetitions (halved at 32K)")
    parser.add_argument("--margin", type=float, default=1.02, help="sage must be this much faster to be picked")
    parser.add_argument("--no-autotune", action="store_true")
    parser.add_argument("--train-step", action="store_true", help="also time the 8B training step (8K, 16K)")
    parser.add_argument("--train-steps", type=int, default=5)
    parser.add_argument("--table", default=str(dispatch.TABLE_PATH), help="dispatch table to write ('' = none)")
    parser.add_argument("--name", default="attention")
    args = parser.parse_args()
    b, h, d = args.batch, args.heads, args.head_dim
    device = torch.cuda.get_device_name(0)
    start = time.time()
    routes_report = validate_routes(d)
    routes = tuple(r for r in ROUTES if routes_report[r]["ok"])
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
    for n in [int(s) for s in args.sizes.split(",")]:
        iters = max(3, args.iters // 2) if n >= 32768 else args.iters  # 32K: ~0.1-1.2 s per call
        for causal in (False, True):
            rows += time_point(b, h, d, n, causal, config, routes, gen, args.accuracy_max_n, iters)
        torch.cuda.empty_cache()
        print(f"N={n} done ({time.time() - start:.0f} s)", flush=True)
    entries = build_table(device, d, rows, routes, args.margin)
    common = dict(args=args, device=device, d=d, rows=rows, routes_report=routes_report, tune=tune, config=config,
                  profile=profile, entries=entries)
    results = _write(**common, train_step=None)  # a cut-off training-step run keeps the sweep
    if args.train_step:
        best_route = min(routes or ("triton",), key=lambda r: sum(x["fwd_bwd_ms"] for x in rows if x["method"] == f"sage+{r}"))
        out = Path("/tmp/attention_train_step.json")
        subprocess.run([sys.executable, str(Path(__file__).with_name("attention_train_step.py")), "--seqs", "8192,16384",
                        "--steps", str(args.train_steps), "--backward", best_route, "--out", str(out),
                        "--timeout", "150"], check=False)
        train_step = json.loads(out.read_text()) if out.exists() else {"failed": True}
        results = _write(**common, train_step=train_step)
    tg = results["targets"]
    print(f"{'N':>6} {'causal':>6} {'method':>12} {'fwd ms':>8} {'fwd TOPS':>8} {'f+b ms':>8} {'f+b TOPS':>8} {'cos':>8} {'relL1':>7}")
    for r in rows:
        print(f"{r['n']:>6} {str(r['causal']):>6} {r['method']:>12} {r['fwd_ms']:8.2f} {r.get('fwd_tops', 0):8.0f} "
              f"{r.get('fwd_bwd_ms', 0):8.2f} {r.get('fwd_bwd_tops', 0):8.0f} {r.get('acc_cos', float('nan')):8.5f} "
              f"{r.get('acc_rel_l1', float('nan')):7.4f}")
    print("targets:", tg, "| sage picked for:", results["dispatch_picks_sage"] or "nothing",
          "| proof:", results["dispatch_proof_every_sage_pick_measured_faster"])


if __name__ == "__main__":
    main()
