"""CPU codec speed: elements/s of decode and encode, compiled kernels against the PyTorch path.

``python benchmarks/codec/codec.py --cpu`` (or this file). For each shape (the default recipe's
matrices and a 1024x4096 one) and mode (lossless bf16; lossy k = 0, 1, 3) it times
``decompress(out=...)`` and ``recompress_`` (what training calls) with the compiled CPU
codec (:mod:`neutrain.compress.codec_cpu`, numba) and with the PyTorch path it replaces
(``NEUTRAIN_CPU_CODEC=torch``: the pointer-jumping decoder, ``count_lanes`` +
``pack_lanes``), plus ``copy_`` of the same bf16 bytes (memory speed). Every fast result
is checked to be the reference's bytes. Times are medians of ``--repeats`` runs; the
machine may be shared, so the file records the load average too.

Writes ``benchmarks/codec/results.jsonl#codec_cpu`` (set ``NEUTRAIN_GIT_COMMIT`` and
``NEUTRAIN_GIT_DIRTY`` where git is not available).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import write_result  # noqa: E402
from neutrain.compress import codec_cpu, compress  # noqa: E402

SHAPES = [("default q/o_proj", (320, 320)), ("default gate/up_proj", (896, 320)),
          ("default embed_tokens", (4096, 320)), ("1024x4096", (1024, 4096))]
MODES = [None, 0, 1, 3]


def _median_s(fn, repeats: int) -> float:
    """Median seconds per call over ``repeats`` samples, each of enough calls to last >= 20 ms."""
    start = time.perf_counter()
    fn()  # warm-up (and the kernels' compile or cache load)
    calls = max(1, min(50, int(0.02 / max(time.perf_counter() - start, 1e-6))))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return median(times)


def _same_bytes(a, b) -> bool:
    return (a.stream_words == b.stream_words and torch.equal(a.stream[: a.stream_words], b.stream[: b.stream_words])
            and torch.equal(a.lane_words, b.lane_words) and torch.equal(a.tile_base, b.tile_base)
            and torch.equal(a._tails_view(), b._tails_view()))


def measure(shape, kept, repeats: int) -> dict:
    """Elements/s of decode and encode, fast and PyTorch path, for one shape and mode."""
    x = (torch.randn(shape) * 0.02).bfloat16()
    y = (x.float() + 1e-3 * torch.randn(shape) * 0.02).bfloat16()  # an "updated" weight to re-encode
    numel = x.numel()
    row = {"shape": list(shape), "mode": "lossless" if kept is None else f"lossy k={kept}", "numel": numel}
    out = torch.empty_like(x)
    row["copy_elems_per_s"] = numel / _median_s(lambda: out.copy_(x), repeats)
    reference = compress(x, kept, backend="reference")
    for label, env in (("fast", None), ("torch", "torch")):
        previous = os.environ.pop("NEUTRAIN_CPU_CODEC", None)
        if env:
            os.environ["NEUTRAIN_CPU_CODEC"] = env
        try:
            ct = compress(x, kept)
            assert _same_bytes(ct, reference), f"{label} encode differs from the reference for {shape} {kept}"
            decoded = ct.decompress()
            assert torch.equal(decoded.view(torch.int16), reference.decompress(backend="reference").view(torch.int16))
            row[f"{label}_decode_elems_per_s"] = numel / _median_s(lambda: ct.decompress(out=out), repeats)
            row[f"{label}_encode_elems_per_s"] = numel / _median_s(lambda: ct.recompress_(y), repeats)
        finally:
            os.environ.pop("NEUTRAIN_CPU_CODEC", None)
            if previous is not None:
                os.environ["NEUTRAIN_CPU_CODEC"] = previous
    row["decode_speedup"] = row["fast_decode_elems_per_s"] / row["torch_decode_elems_per_s"]
    row["encode_speedup"] = row["fast_encode_elems_per_s"] / row["torch_encode_elems_per_s"]
    return row


def run_cpu(repeats: int = 7) -> Path:
    """Measure every shape and mode, print a table and write ``codec_cpu.json``."""
    if not codec_cpu.available():
        raise SystemExit("the compiled CPU codec is not available: pip install 'neutrain[cpu]' (numba)")
    load_before = os.getloadavg()
    rows = []
    for name, shape in SHAPES:
        for kept in MODES:
            row = {"name": name, **measure(shape, kept, repeats)}
            rows.append(row)
            print(f"{name:22s} {row['mode']:10s} decode {row['torch_decode_elems_per_s'] / 1e6:8.1f} -> "
                  f"{row['fast_decode_elems_per_s'] / 1e6:8.1f} M/s   encode {row['torch_encode_elems_per_s'] / 1e6:7.1f}"
                  f" -> {row['fast_encode_elems_per_s'] / 1e6:7.1f} M/s   copy {row['copy_elems_per_s'] / 1e6:8.1f} M/s",
                  flush=True)
    settings = {"repeats": repeats, "statistic": "median seconds per call",
                "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                "numba_threads": codec_cpu.numba.get_num_threads(),
                "load_average_before_after": [list(load_before), list(os.getloadavg())],
                "fast": "neutrain.compress.codec_cpu (numba)", "torch": "NEUTRAIN_CPU_CODEC=torch (PyTorch path)",
                "decode": "decompress(out=...)", "encode": "recompress_(updated weights)"}
    return write_result("codec_cpu", settings, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    print(run_cpu(parser.parse_args().repeats))


if __name__ == "__main__":
    main()
