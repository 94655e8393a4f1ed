"""SageAttention (INT8 QK, FP8 PV) vs torch SDPA's flash and cuDNN backends, same process, same card.

Convention (SageAttention's bench): B=4, H=32, d=128; forward FLOPs = 4*B*H*d*N^2, halved
for causal; forward+backward counts 3.5x the forward FLOPs. "sage" times include the
quantization pre-pass; "sage_kernel" is the forward kernel alone on pre-quantized inputs
(the convention of SageAttention's own charts). "sage_sa2" is plain SageAttention2
(no V residual: one FP8 wgmma per tile). Accuracy columns compare heads 0-3 of batch 0
with exact fp32 attention (sizes up to --accuracy-max-n).

Usage (on the GPU machine)::

    PYTHONPATH=. python benchmarks/attention.py --budget-s 240
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cuda_time_ms, write_result  # noqa: E402

from neutrain.attention import exact_attention, sage_attention  # noqa: E402
from neutrain.attention.quant import quantize_attention_inputs  # noqa: E402
from neutrain.attention.reference import accuracy_metrics  # noqa: E402


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


METHODS = {
    "sage": lambda q, k, v, causal: sage_attention(q, k, v, causal=causal),
    "sage_sa2": lambda q, k, v, causal: sage_attention(q, k, v, causal=causal, v_residual=False),
    "sdpa_flash": _sdpa("flash"),
    "sdpa_cudnn": _sdpa("cudnn"),
}


def sweep_forward_configs(q, k, v, causal, candidates):
    """Time the forward kernel under each (BLOCK_M, warps, stages); return {config: ms}."""
    from neutrain.kernels import sage_attention as kernels

    qi = quantize_attention_inputs(q, k, v, q.shape[-1] ** -0.5)
    times = {}
    for cfg in candidates:
        kernels.FORWARD_CONFIG_OVERRIDE = cfg
        try:
            times[cfg] = cuda_time_ms(lambda: kernels.sage_attention_forward(qi, causal), warmup=2, iters=10)
        except Exception as exc:  # a config can exceed shared memory or registers
            print(f"config {cfg} failed: {type(exc).__name__}: {str(exc)[:120]}")
    kernels.FORWARD_CONFIG_OVERRIDE = None
    return times


def sweep_backward_configs(q, k, v, causal, candidates):
    """Time the backward kernels (dK/dV + dQ) under each config pair; return {config: ms}."""
    from neutrain.kernels import sage_attention as kernels

    qi = quantize_attention_inputs(q, k, v, q.shape[-1] ** -0.5)
    out, lse = kernels.sage_attention_forward(qi, causal)
    grad = torch.randn_like(out)
    times = {}
    for cfg in candidates:
        kernels.BACKWARD_CONFIG_OVERRIDE = cfg
        try:
            times[cfg] = cuda_time_ms(lambda: kernels.sage_attention_backward(qi, out, lse, grad, causal),
                                      warmup=2, iters=5)
        except Exception as exc:
            print(f"backward config {cfg} failed: {type(exc).__name__}: {str(exc)[:120]}")
    kernels.BACKWARD_CONFIG_OVERRIDE = None
    return times


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="4096,8192,16384,32768")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop starting new sizes after this")
    parser.add_argument("--accuracy-max-n", type=int, default=8192)
    parser.add_argument("--no-sweep", action="store_true", help="use the library's default kernel configs")
    parser.add_argument("--name", default="attention", help="result file benchmarks/results/<name>.json")
    args = parser.parse_args()
    from neutrain.kernels import sage_attention as kernels

    b, h, d = args.batch, args.heads, args.head_dim
    sizes = [int(s) for s in args.sizes.split(",")]
    start = time.time()
    results, skipped = [], []
    gen = torch.Generator(device="cuda").manual_seed(0)

    # Pick the forward tile/warps/stages per causal mode at 8K (kept for all sizes).
    candidates = [(128, 8, 2), (128, 8, 3), (128, 8, 4), (64, 4, 3)]
    bwd_candidates = [((32, 8, 2), (128, 64, 8, 2)), ((32, 8, 3), (128, 64, 8, 2)), ((32, 8, 2), (128, 64, 8, 3)),
                      ((32, 8, 3), (128, 64, 8, 3)), ((32, 8, 2), (64, 64, 4, 2))]
    best, best_bwd, sweep, sweep_bwd = {}, {}, {}, {}
    qs, ks, vs = (torch.randn(b, h, 8192, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    if args.no_sweep:
        candidates, bwd_candidates = [kernels._forward_config(d, False)], [kernels._backward_config()]
    for causal in (False, True):
        times = sweep_forward_configs(qs, ks, vs, causal, candidates)
        sweep[str(causal)] = {str(c): t for c, t in times.items()}
        best[causal] = min(times, key=times.get)
        print(f"causal={causal} forward config sweep (ms): {times} -> {best[causal]}")
        times = sweep_backward_configs(qs, ks, vs, causal, bwd_candidates)
        sweep_bwd[str(causal)] = {str(c): t for c, t in times.items()}
        best_bwd[causal] = min(times, key=times.get)
        print(f"causal={causal} backward config sweep (ms): {times} -> {best_bwd[causal]}")
    del qs, ks, vs

    for n in sizes:
        if time.time() - start > args.budget_s:
            skipped.append(n)
            continue
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        grad = torch.randn_like(q)
        heavy = n >= 16384
        warm, iters = (1, 3) if heavy else (3, 10)
        for causal in (False, True):
            kernels.FORWARD_CONFIG_OVERRIDE = best[causal]
            kernels.BACKWARD_CONFIG_OVERRIDE = best_bwd[causal]
            exact = None
            if n <= args.accuracy_max_n:
                exact = exact_attention(q[:1, :4], k[:1, :4], v[:1, :4], causal)
            fwd_flops = attention_flops(b, h, n, d, causal)
            qi = quantize_attention_inputs(q, k, v, d ** -0.5)
            kernel_ms = cuda_time_ms(lambda: kernels.sage_attention_forward(qi, causal), warmup=warm, iters=iters)
            del qi
            row = {"n": n, "causal": causal, "method": "sage_kernel", "fwd_ms": kernel_ms,
                   "fwd_tops": fwd_flops / kernel_ms / 1e9, "forward_config": list(best[causal]),
                   "backward_config": [list(c) for c in best_bwd[causal]]}
            results.append(row)
            print(row)
            for name, fn in METHODS.items():
                row = {"n": n, "causal": causal, "method": name}
                with torch.no_grad():
                    out = fn(q, k, v, causal)
                    if exact is not None:
                        row.update({f"acc_{key}": val for key, val in accuracy_metrics(out[:1, :4], exact).items()})
                    del out
                    row["fwd_ms"] = cuda_time_ms(lambda: fn(q, k, v, causal), warmup=warm, iters=iters)
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

                def fwd_bwd():
                    qg.grad = kg.grad = vg.grad = None
                    fn(qg, kg, vg, causal).backward(grad)

                row["fwd_bwd_ms"] = cuda_time_ms(fwd_bwd, warmup=warm, iters=iters)
                row["fwd_tops"] = fwd_flops / row["fwd_ms"] / 1e9
                row["fwd_bwd_tops"] = attention_flops(b, h, n, d, causal, True) / row["fwd_bwd_ms"] / 1e9
                del qg, kg, vg
                torch.cuda.empty_cache()
                results.append(row)
                print({k_: (round(v_, 4) if isinstance(v_, float) else v_) for k_, v_ in row.items()})
        del q, k, v, grad
        torch.cuda.empty_cache()
    kernels.FORWARD_CONFIG_OVERRIDE = kernels.BACKWARD_CONFIG_OVERRIDE = None
    settings = {"batch": b, "heads": h, "head_dim": d, "sizes": sizes, "skipped_sizes_for_time": skipped,
                "forward_config_sweep_8k_ms": sweep, "backward_config_sweep_8k_ms": sweep_bwd, "flops": "fwd 4*B*H*d*N^2 (/2 causal); fwd+bwd 3.5x fwd",
                "accuracy": "batch 0, heads 0-3 vs exact fp32 attention, N <= %d" % args.accuracy_max_n}
    path = write_result(args.name, settings, results)
    print("wrote", path)
    print(f"{'N':>6} {'causal':>6} {'method':>12} {'fwd TOPS':>9} {'f+b TOPS':>9} {'cos':>8} {'relL1':>7}")
    for r in results:
        print(f"{r['n']:>6} {str(r['causal']):>6} {r['method']:>12} {r.get('fwd_tops', 0):9.1f} "
              f"{r.get('fwd_bwd_tops', 0):9.1f} {r.get('acc_cos', float('nan')):8.5f} {r.get('acc_rel_l1', float('nan')):7.4f}")


if __name__ == "__main__":
    main()
