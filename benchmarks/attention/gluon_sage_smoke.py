"""Device check: the Gluon warp-specialized SageAttention forward against the Triton
Sage kernel and cuDNN SDPA at B=4, H=32, N=16K, d=128, causal and not, on the same card.

For each (causal) and method: the output's accuracy against the Triton kernel (whole tensor) and
against exact fp32 attention (batch 0, heads 0-1), then the forward kernel's time (CUDA events,
median of ``--iters`` after warm-up) on inputs quantized once, the quantization's own time, and
TOPS counted as ``benchmarks/attention/NOTES.md`` does (4*B*H*d*N^2, halved causal). First, the
quantization alone at ``--quant-ns`` lengths (8K, 16K, 32K), its older separate passes against the one
stats pass (``quant_variants_ms`` in the record: ms per length and variant, and whether the two give the
same Q and V bit for bit). Methods:
``gluon_c1_s2`` (one consumer warpgroup, 2 ring slots), ``gluon_c2_s2``, ``gluon_c2_s3``
(two consumer warpgroups), ``gluon_c2_s2_pp``, ``gluon_c2_s3_pp`` (two, in FA3's ping-pong), ``triton_sage`` (the dispatch table's kernel config: BLOCK_M 128,
8 warps, 3 stages, one K scale per tile) and ``sdpa_cudnn`` (bf16). Peak memory is recorded
three ways per method (allocated, reserved, NVML device used). Each method is isolated: one that
fails (compile error, hang caught by the caller's timeout, wrong output) is printed with its
traceback and the others still run. Writes ``gluon_sage_smoke.json`` under ``$OUT`` (and
its row in ``benchmarks/attention/results.jsonl``) and prints every number.

    PYTHONPATH=. python benchmarks/attention/gluon_sage_smoke.py [--n 16384] [--iters 10]

Not attention.json: the dispatch table and the issue's targets are rebuilt by
``benchmarks/attention/attention.py`` once the kernel is measured (phase 2).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks._common import cuda_time_ms, write_result  # noqa: E402
from benchmarks.memory._train_peers import device_used_gib  # noqa: E402

from neutrain.attention.quant import TILE, _quantize_cuda, quantize_attention_inputs, round_up  # noqa: E402
from neutrain.attention.reference import accuracy_metrics, exact_attention  # noqa: E402


def _methods():
    """name -> fn(qi, q, k, v, causal) returning O [B,H,N,D] (bf16)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from neutrain.kernels import sage_attention as triton_sage
    from neutrain.kernels import sage_attention_gluon as gluon_sage

    def gluon(consumers, stages, pingpong=False):
        cfg = gluon_sage.GluonConfig(num_consumers=consumers, num_stages=stages, pingpong=pingpong)
        return lambda qi, q, k, v, causal: gluon_sage.sage_attention_forward_gluon(qi, causal, config=cfg)[0]

    shipped = triton_sage.ForwardConfig(128, 8, 3, False)

    def cudnn(qi, q, k, v, causal):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    # Baselines first: a Gluon variant that hangs until the caller's timeout must not cost them.
    return {
        "triton_sage": lambda qi, q, k, v, causal: triton_sage.sage_attention_forward(qi, causal, config=shipped)[0],
        "sdpa_cudnn": cudnn,
        "gluon_c1_s2": gluon(1, 2),
        "gluon_c2_s2": gluon(2, 2),
        "gluon_c2_s3": gluon(2, 3),
        "gluon_c2_s2_pp": gluon(2, 2, True),
        "gluon_c2_s3_pp": gluon(2, 3, True),
    }


def _sass(name):
    """Registers, spills and MMA opcode counts of the kernel a Gluon method just launched."""
    if not name.startswith("gluon"):
        return None
    from neutrain.kernels import sage_attention_gluon as gluon_sage

    s = gluon_sage.sass_summary(gluon_sage._LAST_LAUNCH["forward"])
    ops = s["opcodes"]
    return {"registers": s["registers"], "spills": s["spills"],
            **{op: ops.get(op, 0) for op in ("IGMMA", "QGMMA", "MUFU", "USETMAXREG", "UTMALDG", "BAR", "SYNCS")}}


PV_FORMS = {"residual": True, "plain": False}  # PV with V's FP8 residual (a second product a tile), or plain Sage2's


def _method_pv_forms(methods, pv_forms):
    """(row name, method, PV form): SDPA once, each Sage kernel once per PV form (plain ones named ``+plain``)."""
    for name in methods:
        if name.startswith("sdpa"):
            yield name, name, None
            continue
        for form in pv_forms:
            yield (name if form == "residual" else f"{name}+plain"), name, form


#: ``_quantize_cuda``'s variants: K's mean and V's amax in torch with one token group per Q/K program
#: (``separate_passes``), or one Triton pass over K and V for both, then a tile per program.
QUANT_VARIANTS = {"separate_passes": True, "one_stats_pass": False}


def time_quant_variants(b, h, d, ns, iters, pv_form, device="cuda"):
    """{str(n): {variant: ms, ...}}: the quantization alone (Q, K, V; K scale per tile as the Sage
    kernels run it), CUDA events, median of ``iters`` after warm-up, fresh inputs per length."""
    out = {}
    for n in ns:
        gen = torch.Generator(device=device).manual_seed(37)
        q, k, v = (torch.randn(b, h, n, d, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(3))
        rec, results = {"pv": pv_form}, {}
        for name, separate in QUANT_VARIANTS.items():
            def fn(separate=separate):
                return _quantize_cuda(q, k, v, d ** -0.5, 8, 16, TILE, PV_FORMS[pv_form], round_up(n, TILE),
                                      separate_passes=separate)
            try:
                rec[name] = cuda_time_ms(fn, 3, iters)
                results[name] = fn()
            except Exception as exc:  # the other variant still runs; the log has the traceback
                traceback.print_exc()
                rec[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:500]
        if len(results) == 2:
            old, new = results.values()
            same = [torch.equal(getattr(old, f).view(torch.uint8), getattr(new, f).view(torch.uint8))
                    for f in ("q_int", "v_fp8_t") + (("v_residual_t",) if new.v_residual_t is not None else ())]
            same += [torch.equal(old.q_scale, new.q_scale), torch.equal(old.v_scale, new.v_scale)]
            rec["q_v_identical"] = all(same)
            rec["k_mean_max_abs_diff"] = float((old.k_mean - new.k_mean).abs().max())
        if "separate_passes" in rec and "one_stats_pass" in rec:
            rec["speedup"] = rec["separate_passes"] / rec["one_stats_pass"]
        print(f"quantization alone, N={n}: " + ", ".join(
            f"{key} {val:.4g}" if isinstance(val, float) else f"{key} {val}" for key, val in rec.items()), flush=True)
        out[str(n)] = rec
        del q, k, v, results
        torch.cuda.empty_cache()
    return out


def run(b, h, n, d, iters, pv_forms=("residual",)):
    gen = torch.Generator(device="cuda").manual_seed(31)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    rows, methods = [], _methods()
    quant_ms, qis = {}, {}
    for form in pv_forms:
        residual = PV_FORMS[form]
        quant_ms[form] = cuda_time_ms(lambda: quantize_attention_inputs(q, k, v, d ** -0.5, k_group=TILE,
                                                                        v_residual=residual), 2, iters)
        print(f"quantization, PV {form} (K, V stats pass, then Q, K, V; K scale per tile): {quant_ms[form]:.3f} ms",
              flush=True)
        qis[form] = quantize_attention_inputs(q, k, v, d ** -0.5, k_group=TILE, v_residual=residual)
    for causal in (False, True):
        flops = 4.0 * b * h * d * n * n / (2 if causal else 1)
        exact = exact_attention(q[:1, :2], k[:1, :2], v[:1, :2], causal)
        baseline = None
        for row_name, name, form in _method_pv_forms(methods, pv_forms):
            row = {"n": n, "causal": causal, "method": row_name, "pv": form}
            qi = qis[form or pv_forms[0]]
            try:
                fn = methods[name]
                with torch.no_grad():
                    out = fn(qi, q, k, v, causal)
                    torch.cuda.synchronize()
                    row.update({f"exact_{key}": val for key, val in accuracy_metrics(out[:1, :2], exact).items()})
                    if row_name == "triton_sage" or (name == "triton_sage" and baseline is None):
                        baseline = out
                    elif baseline is not None:
                        row["cos_vs_triton_sage"] = accuracy_metrics(out, baseline)["cos"]
                    del out
                    row["sass"] = _sass(name)
                    torch.cuda.reset_peak_memory_stats()
                    row["fwd_ms"] = cuda_time_ms(lambda: fn(qi, q, k, v, causal), 3, iters)
                    row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
                    row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
                    row["nvml_used_gib"] = device_used_gib()
                row["tops"] = flops / row["fwd_ms"] / 1e9
                if form is not None:
                    row["tops_with_quant"] = flops / (row["fwd_ms"] + quant_ms[form]) / 1e9
            except Exception as exc:  # keep measuring the others; the log has the traceback
                traceback.print_exc()
                row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            print({k_: (round(v_, 5) if isinstance(v_, float) else v_) for k_, v_ in row.items()}, flush=True)
            rows.append(row)
    return rows, quant_ms


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--b", type=int, default=4)
    parser.add_argument("--h", type=int, default=32)
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--quant-ns", default="8192,16384,32768",
                        help="lengths at which to time the quantization alone, comma-separated (empty: none)")
    parser.add_argument("--pv", default="plain", help="PV forms, comma-separated: plain (SageAttention2's one "
                        "product a tile, every Sage call's default), residual (V's FP8 residual, a second product), "
                        "or both")
    args = parser.parse_args()
    pv_forms = tuple(PV_FORMS) if args.pv == "both" else tuple(args.pv.split(","))
    unknown = [form for form in pv_forms if form not in PV_FORMS]
    if unknown:
        parser.error(f"--pv: unknown form {unknown[0]!r}; expected residual, plain or both")
    quant_ns = [int(x) for x in args.quant_ns.split(",") if x.strip()]
    quant_variants = time_quant_variants(args.b, args.h, args.d, quant_ns, args.iters, pv_forms[0])
    rows, quant_ms = run(args.b, args.h, args.n, args.d, args.iters, pv_forms)
    cudnn = {r["causal"]: r.get("fwd_ms") for r in rows if r["method"] == "sdpa_cudnn"}
    print(f"\n{'method':<20} {'causal':<7} {'ms':>9} {'TOPS':>7} {'+quant':>7} {'/cuDNN':>7} {'cos fp32':>9} {'cos triton':>10}")
    for r in rows:
        if "fwd_ms" not in r:
            print(f"{r['method']:<20} {r['causal']!s:<7} FAILED: {r.get('error', '')[:200]}")
            continue
        ratio = cudnn.get(r["causal"]) / r["fwd_ms"] if cudnn.get(r["causal"]) else float("nan")
        with_quant = r.get("tops_with_quant", r["tops"])
        print(f"{r['method']:<20} {r['causal']!s:<7} {r['fwd_ms']:9.3f} {r['tops']:7.1f} {with_quant:7.1f} {ratio:7.3f} "
              f"{r.get('exact_cos', float('nan')):9.6f} {r.get('cos_vs_triton_sage', float('nan')):10.6f}")
    if quant_variants:
        print(f"\nquantization alone, B={args.b} H={args.h} d={args.d}, PV {pv_forms[0]} (ms)")
        print(f"{'N':>7} {'separate passes':>16} {'one stats pass':>15} {'speedup':>8} {'Q,V same':>9}")
        nan = float("nan")
        for n, rec in quant_variants.items():
            print(f"{n:>7} {rec.get('separate_passes', nan):16.3f} {rec.get('one_stats_pass', nan):15.3f} "
                  f"{rec.get('speedup', nan):8.2f} {rec.get('q_v_identical', '-')!s:>9}")
    gluon = [r for r in rows if r["method"].startswith("gluon") and "tops" in r and not r["causal"]]
    best = max(gluon, key=lambda r: r["tops"]) if gluon else None
    targets = {}
    if best is not None:
        targets["sage_fwd_tops_n16k_d128"] = {
            "value": round(best["tops"], 1), "goal": ">= 800", "unit": "TOPS",
            "derived_from": f"{best['method']}, non-causal, kernel only (quantization "
                            f"{quant_ms[best['pv']]:.2f} ms apart)"}
    config = vars(args) | {"quant_ms": quant_ms, "quant_variants_ms": quant_variants, "pv_forms": list(pv_forms)}
    write_result("gluon_sage_smoke", config, rows, targets=targets,
                 targets_note="a diagnostic of the Gluon forward; attention.json carries the attention targets")


if __name__ == "__main__":
    main()
