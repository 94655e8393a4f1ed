"""Host cost of the sync-free re-encode (``recompress_(x, sync=False)``, what the fused update calls).

``python benchmarks/codec/codec_encode_host.py`` (or ``benchmarks/codec/codec.py --encode-host``), GPU only.
For each Llama-3-8B matrix shape it measures, with the codec's launches going through
:class:`neutrain.kernels.launch.Launcher` (``fast``) and through Triton's Python dispatch
(``triton``, ``launch.FAST = False``), in the same process:

* ``host_us``: wall time per call of 100 back-to-back ``recompress_(sync=False)`` calls, read
  before any synchronisation (the GPU queue holds them all, so this is the Python cost), and
  the same for the three kernel launches alone (``kernels_host_us``);
* ``api_GBps`` / ``kernels_GBps``: bf16 input bytes per second, steady (CUDA events around 20
  back-to-back calls, median of 15), inputs rotating over >= 200 MB; ``copy_GBps`` beside them.

Then the fused LOMO update followed by its re-encode, as training runs them (``update``):
the update alone, update + two-pass encode, and update counting code lengths + the
counted encode (:mod:`neutrain.compress.counted`: the encode reads the weight once). The
update runs with ``lr = 0`` and stochastic rounding, so the weights never drift (no code
rebuild) while the kernels do all their work.

Every re-encoded tensor is checked to decode to its input. ``encode_over_copy`` is the
count-weighted copy time over the API's, the encode's target (goal 0.5);
``counted_encode_over_copy`` uses the encode's share of update + counted encode instead
(that time minus the update alone's). Writes ``benchmarks/codec/results.jsonl#codec_encode_host``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import write_result  # noqa: E402
from benchmarks.codec._codec_timing import LLAMA3_8B, encode_kernels_only, gbs, rotating_sets, same_bits, steady_ms  # noqa: E402
from neutrain.compress import counted  # noqa: E402
from neutrain.kernels import launch  # noqa: E402
from neutrain.kernels.fused_update import fused_update_  # noqa: E402

CALLS = 100


def _host_us(fn) -> float:
    """Python time per call: ``CALLS`` calls timed on the host before the GPU is waited for."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    host = (time.perf_counter() - start) / CALLS * 1e6
    torch.cuda.synchronize()
    return host


def measure(shape) -> dict:
    xs, cts, outs, pick = rotating_sets(shape, None, None)
    nbytes = 2 * xs[0].numel()

    def api():
        i = pick()
        cts[i].recompress_(xs[i], sync=False)

    def kernels():
        i = pick()
        encode_kernels_only(cts[i], xs[i])

    def copy():
        i = pick()
        outs[i].copy_(xs[i])

    row = {"copy_GBps": gbs(nbytes, steady_ms(copy))}
    for mode in ("fast", "triton"):
        launch.FAST = mode == "fast"
        try:
            api_ms, kernels_ms = steady_ms(api), steady_ms(kernels)
            row[mode] = {"host_us": _host_us(api), "kernels_host_us": _host_us(kernels), "api_ms": api_ms,
                         "api_GBps": gbs(nbytes, api_ms), "kernels_GBps": gbs(nbytes, kernels_ms)}
        finally:
            launch.FAST = True
    row["copy_ms"] = nbytes / row["copy_GBps"] / 1e6
    for ct, x in zip(cts, xs):
        assert same_bits(ct.decompress(), x), f"re-encode of {shape} does not decode to its input"
    del xs, cts, outs
    torch.cuda.empty_cache()
    return row


def measure_update(shape) -> dict:
    """Fused update (lr 0, stochastic rounding) + re-encode: two-pass against counted, ms per matrix."""
    xs, cts, _, pick = rotating_sets(shape, None, None)
    g = torch.randn(shape, device="cuda").mul(0.01).bfloat16()
    ok = torch.tensor(True, device="cuda")

    def update(i, count=None):
        fused_update_(xs[i], g, lr=0.0, ok=ok, seed=1, count=count)

    def plain():
        i = pick()
        update(i)
        cts[i].recompress_(xs[i], sync=False)

    def fused():
        i = pick()
        update(i, counted.begin(cts[i], xs[i]))
        cts[i].recompress_(xs[i], sync=False)

    row = {"update_ms": steady_ms(lambda: update(pick()))}
    row["update_then_encode_ms"] = steady_ms(plain)
    row["update_counting_then_counted_encode_ms"] = steady_ms(fused)
    for ct, x in zip(cts, xs):
        assert same_bits(ct.decompress(), x), f"counted re-encode of {shape} does not decode to its input"
    del xs, cts
    torch.cuda.empty_cache()
    return row


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("codec_encode_host.py needs a CUDA GPU")
    torch.manual_seed(0)
    rows = []
    for name, shape, count in LLAMA3_8B:
        row = {"name": name, "shape": list(shape), "count": count, **measure(shape), "update": measure_update(shape)}
        rows.append(row)
        print(f"{name:22s} copy {row['copy_GBps']:.0f} GB/s | " + " | ".join(
            f"{m}: host {row[m]['host_us']:.1f} us/call (kernels {row[m]['kernels_host_us']:.1f}),"
            f" API {row[m]['api_GBps']:.0f} GB/s, kernels {row[m]['kernels_GBps']:.0f}" for m in ("fast", "triton")),
            flush=True)
        update = row["update"]
        print(f"{'':22s} update {update['update_ms']:.3f} ms, + encode {update['update_then_encode_ms']:.3f},"
              f" counting + counted encode {update['update_counting_then_counted_encode_ms']:.3f}", flush=True)
    copy_ms = sum(r["copy_ms"] * r["count"] for r in rows)
    targets = {"encode_over_copy": {"value": copy_ms / sum(r["fast"]["api_ms"] * r["count"] for r in rows),
                                    "goal": 0.5}}
    dispatch = copy_ms / sum(r["triton"]["api_ms"] * r["count"] for r in rows)
    encode_share = sum((r["update"]["update_counting_then_counted_encode_ms"] - r["update"]["update_ms"]) * r["count"]
                       for r in rows)
    targets["counted_encode_over_copy"] = {"value": copy_ms / encode_share, "goal": 0.5}
    print(f"encode_over_copy: {targets['encode_over_copy']['value']:.3f} (through Triton's dispatch: {dispatch:.3f});"
          f" counted: {targets['counted_encode_over_copy']['value']:.3f}")
    settings = {"inputs": "Llama-3-8B weight shapes, N(0, 0.02) bf16, rotating over >= 200 MB",
                "host_us": f"wall time per call of {CALLS} back-to-back calls before synchronising",
                "GBps": "bf16 input bytes per second; steady: CUDA events around 20 calls, median of 15",
                "modes": "fast: kernels.launch.Launcher; triton: launch.FAST = False (Triton's dispatch)"}
    write_result("codec_encode_host", settings, {"shapes": rows, "encode_over_copy_triton_dispatch": dispatch},
                 targets=targets)


if __name__ == "__main__":
    main()
