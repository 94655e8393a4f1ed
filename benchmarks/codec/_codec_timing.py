"""What the codec's benchmarks share: Llama-3-8B's matrix shapes, steady CUDA timing and rotating inputs.

``benchmarks/codec/codec.py`` (sizes and speeds) and ``benchmarks/codec/codec_encode_host.py`` (the re-encode's
host cost) both time the codec this way, so their GB/s compare.
"""

from __future__ import annotations

import itertools
import math
from statistics import median
from typing import Callable

import torch

from neutrain.compress import CompressedTensor, compress

# (name, shape, matrices of this shape in the model)
LLAMA3_8B = [
    ("q_proj/o_proj", (4096, 4096), 64),
    ("k_proj/v_proj", (1024, 4096), 64),
    ("gate_proj/up_proj", (14336, 4096), 64),
    ("down_proj", (4096, 14336), 32),
    ("embed_tokens/lm_head", (128256, 4096), 2),
]

ROTATE_BYTES = 200 * 2**20
"""Bytes of input sets cycled through, so that L2 does not hold them."""


def gbs(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def steady_ms(fn: Callable[[], object], reps: int = 20, warmup: int = 3, iters: int = 15) -> float:
    """Median milliseconds per call of ``reps`` back-to-back calls between two CUDA events.

    Why not one call per event pair: a small kernel then also times its own launch from Python
    (tens of microseconds for a Triton launch), with the GPU idle meanwhile. In training the host
    runs ahead of the GPU (no host reads), so back-to-back throughput is what counts; copy_ gets
    the same treatment. ``measure_shape`` also reports single-call times.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return float(median(times))


def encode_kernels_only(ct: CompressedTensor, x: torch.Tensor, warps=None) -> None:
    """The two lossless passes of a sync-free re-encode, without the API's bookkeeping."""
    from neutrain.compress import stream as kstream
    from neutrain.kernels import codec as kcodec

    counts, scratch, cum = kstream.kernel_scratch(ct)
    kcodec.count_lossless(x, ct.enc_table, counts, scratch, ct.steps, ct.lanes, ct.elems, num_warps=warps, cum=cum)
    kcodec.pack_lossless(x, ct.enc_table, counts, cum, ct.stream.numel(), ct.stream, ct.tails, ct.lane_words,
                         ct.tile_base, ct.status.tensor, ct.steps, ct.lanes, ct.elems, num_warps=warps)


def rotating_sets(shape, mantissa_bits, steps):
    """Enough (input, output, compressed) sets to exceed the L2 cache when cycled (>= 200 MB in all)."""
    count = max(1, min(24, ROTATE_BYTES // (2 * math.prod(shape))))
    xs = [torch.randn(shape, device="cuda").mul_(0.02).bfloat16() for _ in range(count)]
    cts = [compress(x, mantissa_bits, steps=steps) for x in xs]
    outs = [torch.empty_like(x) for x in xs]
    cycle = itertools.cycle(range(count))
    return xs, cts, outs, lambda: next(cycle)

