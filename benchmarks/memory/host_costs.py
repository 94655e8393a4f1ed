"""Host time of each piece of the compressed step's per-weight path, against its device time (a GPU).

One Llama-3-8B decoder layer's seven matrices, compressed as training builds them. For each piece, ``N`` calls
in a row: host microseconds per call (the Python until the call returns, nothing synchronised in between) and
device microseconds per call (CUDA events around the ``N`` calls, after a synchronise). A piece whose host time
exceeds its device time sets the pace of a step whose device work is small (batch 1).

Pieces: the decode kernel's launch (``ct.decompress(out=...)``), a decode through the buffers
(``CompressedWeight.decode``, alternating weights so every call decodes), the seven decoded in grouped launches
(``decode_many``), the sync-free re-encode (``recompress_(sync=False)``) and its grouped twin (``encode_many``),
and for scale a bf16 ``torch.mm`` of the layer's shape at 1,024 tokens and an empty ``torch.empty(0)`` op.

    python benchmarks/memory/host_costs.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _measure(fn, n: int) -> tuple[float, float]:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    b.record()
    b.synchronize()
    return host, a.elapsed_time(b) / n * 1e3


def main() -> int:
    import torch

    from neutrain.compress import compress, decode_many, encode_many
    from neutrain.nn import CompressedWeight

    torch.manual_seed(0)
    shapes = {"q": (4096, 4096), "k": (1024, 4096), "v": (1024, 4096), "o": (4096, 4096),
              "gate": (14336, 4096), "up": (14336, 4096), "down": (4096, 14336)}
    dense = {n: (torch.randn(s, device="cuda") * 0.02).bfloat16() for n, s in shapes.items()}
    weights = [CompressedWeight(compress(w), name=n) for n, w in dense.items()]
    cts = [w.ct for w in weights]
    outs = [torch.empty_like(d) for d in dense.values()]
    rows = []

    def row(name, fn, n=200, per=1):
        host, dev = _measure(fn, n)
        rows.append((name, host / per, dev / per))

    row("torch.empty(0) on the GPU", lambda: torch.empty(0, device="cuda"), 2000)
    x = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
    row("mm 1024x4096 @ 4096x14336^T", lambda: x.mm(dense["gate"].t()), 200)
    row("ct.decompress(out) (one launch)", lambda: cts[4].decompress(out=outs[4]), 500)
    k = [0]

    def decode_next():
        k[0] += 1
        weights[k[0] % 7].decode()

    row("CompressedWeight.decode (slot, always a miss)", decode_next, 700)
    row("decode_many of the 7 (per weight)", lambda: decode_many(cts, outs), 100, per=7)
    row("recompress_(sync=False) (gate)", lambda: cts[4].recompress_(outs[4], sync=False), 300)
    row("encode_many of the 7 (per weight)", lambda: encode_many(cts, outs), 100, per=7)
    for ct, out, d in zip(cts, outs, dense.values()):
        assert torch.equal(ct.decompress().view(torch.int16), d.view(torch.int16)), "codec round trip"
    print(f"{'piece':50} {'host us':>9} {'device us':>10}")
    for name, host, dev in rows:
        print(f"{name:50} {host:9.1f} {dev:10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
