"""Device check: ShadowKV's landmark scoring (the selection's product) in the form it has and in the form that
reads the landmarks as the long operand, on the 64K and 128K decode shapes (Llama-3-8B: 8 KV heads, groups of 4,
d=128, chunks of 8), each timed with CUDA events after warm-up, the landmark bytes over the time beside it.

The replayed step's kernel table put one ``cutlass ... 256x64`` GEMM a layer at ~314 us (10 ms of a 52 ms step at
64K, batch 32): the scores' einsum batches 4 query rows against 8,192 landmarks, a shape whose tiles waste most of
the product: the probe times it on a packed query and on the strided view attention hands over, and the whole
selection (``select_chunks``: scores, softmax, max over the group, top-k). ``landmarks @ q^T`` makes the landmarks the M side (M=8,192, N=4), which cuBLAS serves as a GEMV-like
kernel; both give the same logits up to summation order.

    PYTHONPATH=. python benchmarks/kv/shadowkv_selection_probe.py [--batch 32 16] [--contexts 65536 131072]
"""

from __future__ import annotations

import argparse
import json

import torch


def scores_einsum(q, landmarks):
    return torch.einsum("bhgmd,bhcd->bhgmc", q, landmarks)


def scores_einsum_strided(q, landmarks):
    # The decode query as attention hands it over: [b, hq, 1, d] viewed from [b, 1, hq, d] (not packed).
    b, h, g, m, d = q.shape
    strided = q.reshape(b, m, h * g, d).transpose(1, 2).view(b, h, g, m, d)
    return torch.einsum("bhgmd,bhcd->bhgmc", strided, landmarks)


def selection(q, landmarks, k=128):
    from neutrain.eval.kv.shadowkv_math import select_chunks

    b, h, g, m, d = q.shape
    return select_chunks(q.reshape(b, m, h * g, d).transpose(1, 2), landmarks, k, d ** -0.5)


def scores_landmarks_major(q, landmarks):
    b, h, g, m, d = q.shape
    # [b, h, C, d] @ [b, h, d, g*m] -> [b, h, C, g*m]: the landmarks stream once as the long side.
    out = torch.matmul(landmarks, q.reshape(b, h, g * m, d).transpose(-1, -2))
    return out.transpose(-1, -2).reshape(b, h, g, m, -1)


def time_ms(fn, iters=50):
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graphed(fn):
    """``fn`` captured once in a CUDA graph (as the decode step is) and replayed: cuBLAS may pick another kernel
    under capture than in eager mode, which the replayed step's kernel table would show and an eager probe not."""
    def run(q, landmarks):
        if not hasattr(run, "graph"):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    fn(q, landmarks)
            torch.cuda.current_stream().wait_stream(side)
            run.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(run.graph):
                run.out = fn(q, landmarks)
        run.graph.replay()
        return run.out
    return run


def kernels(fn, q, landmarks):
    """The CUDA kernels one call launches, by name (the first 60 characters)."""
    from torch.profiler import ProfilerActivity, profile

    fn(q, landmarks)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(q, landmarks)
        torch.cuda.synchronize()
    return sorted({e.name[:60] for e in prof.events() if e.device_type.name == "CUDA"})


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[32, 16])
    p.add_argument("--contexts", type=int, nargs="+", default=[65536, 131072])
    p.add_argument("--chunk", type=int, default=8)
    args = p.parse_args()
    rows = []
    for n, b in zip(args.contexts, args.batch):
        h, g, d, c = 8, 4, 128, n // args.chunk - 48
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, h, g, 1, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        landmarks = torch.randn(b, h, c, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref = scores_einsum(q, landmarks).float()
        gbytes = landmarks.numel() * 2 / 1e9
        forms = (("einsum", scores_einsum), ("einsum_strided_query", scores_einsum_strided),
                 ("landmarks_major", scores_landmarks_major), ("select_chunks", selection),
                 ("einsum_strided_query_graphed", graphed(scores_einsum_strided)),
                 ("select_chunks_graphed", graphed(selection)))
        for name, fn in forms:
            out = fn(q, landmarks)
            ms = time_ms(lambda: fn(q, landmarks))
            rows.append({"context": n, "batch": b, "form": name, "ms": round(ms, 4),
                         "landmark_gb_per_s": round(gbytes / ms * 1e3, 1),
                         "max_abs_vs_einsum": None if name.startswith("select_chunks") else float((out.float() - ref).abs().max()),
                         "kernels": kernels(fn, q, landmarks)})
            print(rows[-1], flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
