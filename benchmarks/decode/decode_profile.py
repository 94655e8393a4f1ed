"""Where one batch-1 decode step's time goes: the kernel table and the gaps of a graph-replayed engine step.

``ar_roofline_fraction_8b`` stays near 0.51: the dense Llama-3-8B step takes ~6.9 ms against ~3.6 ms of bytes.
The isolated GEMV timings of ``engine_decode.py`` cannot say why (each is one launch timed alone, ~50 us of
event and launch floor for an 8 us read, with the matrix partly in L2). This traces the real step instead:

* the engine (``DecodeEngine``, CUDA graph per step, fused Q/K/V and gate/up) after a prefill, ``--steps``
  replays timed by CUDA events (the step time the target uses);
* ``engine_graph_compiled``: the same with the decoder layers compiled for the one-token step
  (``DecodeEngine(compile_layers=True)``, :mod:`neutrain.decode.compiled_layers`), its first step (capture and
  compilation) timed apart and its greedy tokens compared with the eager row's;
* one profiled block of ``--profiled`` replays (torch.profiler, CUPTI traces the kernels inside a graph): per
  kernel name its count and device time per step, grouped into ``product`` (GEMV/GEMM, cuBLAS or Triton),
  ``attention``, ``norm_and_pointwise`` and ``other``; the union of kernel intervals (device busy), the idle
  time between kernels and its distribution; and the achieved bandwidth of the products: the weight bytes a
  step must read over the products' summed device time (the table: ``benchmarks/memory/_timeline.py``).

Each ``--weights`` entry (dense, neuzip-lossless: the zgemv layout read inside the product) runs in turn on
the same random model. The JSON goes to ``--out`` (and ``$OUT``); the Chrome trace of each profiled block
is written gzipped beside it.

    python benchmarks/decode/decode_profile.py --out /tmp/decode_profile            # GPU, Llama-3-8B shapes
    python benchmarks/decode/decode_profile.py --tiny --out /tmp/decode_profile     # CPU smoke test (no trace)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import git_provenance  # noqa: E402
from benchmarks.decode._spec_decode import GOALS  # noqa: E402  (the decode targets' names and goals)
from benchmarks.memory._timeline import profile_kernels, timeline_table  # noqa: E402
from benchmarks.decode.engine_decode import build, bytes_per_token, copy_bandwidth, free, sync  # noqa: E402
from benchmarks.memory.train_memory import LLAMA3_8B, TINY  # noqa: E402
from neutrain.decode.engine import DecodeEngine  # noqa: E402


TARGETS_NOTE = ("the decode targets as this diagnostic measures them (each row's CUDA-event step); the binding "
                "record is engine_decode.json")


def profile_targets(rows: dict, roofline_step_ms: float) -> dict:
    """The decode targets from the rows' ``step_ms``: ``ar_roofline_fraction_8b`` from the fastest dense row, and
    ``neuzip_lossless_over_bf16_decode`` as the fastest dense step over the fastest NeuZip-lossless step (so a
    change that speeds both is not credited to the compression), each saying which rows it took."""
    steps = {key: row["step_ms"] for key, row in rows.items() if row.get("step_ms")}
    dense = {k: v for k, v in steps.items() if k.startswith("dense/")}
    lossless = {k: v for k, v in steps.items() if k.startswith("neuzip-lossless/")}
    targets = {}
    if dense:
        best = min(dense, key=dense.get)
        targets["ar_roofline_fraction_8b"] = {"value": roofline_step_ms / dense[best],
                                              "goal": GOALS["ar_roofline_fraction_8b"], "derived_from": best}
        if lossless:
            fastest = min(lossless, key=lossless.get)
            targets["neuzip_lossless_over_bf16_decode"] = {
                "value": dense[best] / lossless[fastest], "goal": GOALS["neuzip_lossless_over_bf16_decode"],
                "derived_from": f"{fastest} over {best}"}
    return targets


def retarget(path: str) -> dict:
    """Recompute a stored record's targets from its rows with :func:`profile_targets` (rows and provenance as
    measured); the record says so in ``targets_recomputed``."""
    record = json.loads(Path(path).read_text())
    record["targets"] = profile_targets(record["rows"], record["roofline_step_ms"])
    record["targets_note"] = TARGETS_NOTE
    record["targets_recomputed"] = "by benchmarks/decode/decode_profile.py --retarget from the rows as measured"
    Path(path).write_text(json.dumps(record, indent=1))
    return record


def profile_engine(engine, prompt, steps: int, profiled: int, trace_path: Path | None, weight_bytes: float) -> dict:
    with torch.no_grad():
        engine.prefill(prompt)
        for _ in range(3):  # the capture, then warm replays
            engine.step()
        cuda = prompt.device.type == "cuda"
        row: dict = {}
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                engine.step()
            end.record()
            end.synchronize()
            row["step_ms"] = start.elapsed_time(end) / steps
        if trace_path is None:
            return row
        engine.prefill(prompt)
        engine.step()
        kernels = profile_kernels(engine.step, profiled, trace_gz=trace_path)
        row.update(timeline_table(kernels, profiled, weight_bytes))
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    parser.add_argument("--weights", default="dense,neuzip-lossless")
    parser.add_argument("--steps", type=int, default=50, help="replays timed by CUDA events")
    parser.add_argument("--profiled", type=int, default=5, help="replays in the profiled block")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--check", type=int, default=128, help="greedy tokens compared with the first row's")
    parser.add_argument("--methods", default="all", help="rows to run, comma-separated (default: all)")
    parser.add_argument("--out", default="/tmp/decode_profile")
    parser.add_argument("--retarget", metavar="JSON", default=None,
                        help="recompute the targets of a stored decode_profile record from its rows, and exit")
    args = parser.parse_args(argv)
    if args.retarget:
        return retarget(args.retarget)
    from transformers import LlamaConfig

    commit, dirty = git_provenance()  # before measuring: a run that cannot name its code fails at once

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = LlamaConfig(**dict(TINY if args.tiny else LLAMA3_8B), bos_token_id=None, eos_token_id=None, pad_token_id=0)
    config._attn_implementation = "sdpa"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(device)
    read = bytes_per_token(config, args.prompt_len + args.steps / 2, elem=torch.finfo(dtype).bits // 8)
    record = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "git_commit": commit, "git_dirty": dirty,
              "targets": {}, "targets_note": TARGETS_NOTE,
              "settings": vars(args), "bytes_per_token": read,
              "copy_bandwidth_bytes_per_s": copy_bandwidth(device, 1 << (24 if args.tiny else 31)), "rows": {}}
    bw = record["copy_bandwidth_bytes_per_s"]
    record["roofline_step_ms"] = 1e3 * read["total"] / bw
    for weights in args.weights.split(","):
        t0 = time.perf_counter()
        model = build(config, weights, device, dtype)
        variants = {"dense": [("engine_graph", {}), ("engine_graph_compiled", {"compile_layers": True})],
                    "neuzip-lossless": [("engine_graph_zgemv", {"zgemv": True}),
                                        ("engine_graph_zgemv_compiled", {"zgemv": True, "compile_layers": True})]
                    }.get(weights, [])
        reference = None
        for method, extra in variants:
            if method not in args.methods.split(",") and args.methods != "all":
                continue
            t1 = time.perf_counter()
            trace = out / f"trace_{weights}_{method}.json.gz" if device.type == "cuda" else None
            try:
                engine = DecodeEngine(model, args.prompt_len + max(args.steps + args.profiled, args.check) + 16,
                                      fuse=True, **extra)
                with torch.no_grad():
                    engine.prefill(prompt)
                    engine.step()  # the capture (and, for a compiled row, the compilation)
                sync(device)
                first_step_s = time.perf_counter() - t1
                row = profile_engine(engine, prompt, args.steps, args.profiled, trace, read["weights"])
                row["first_step_s"] = round(first_step_s, 1)
                with torch.no_grad():  # greedy tokens against the weights' first row (the eager layers)
                    tokens = engine.generate(prompt, args.check).cpu()
                if reference is None:
                    reference = tokens
                row["greedy_equal_to_first_row"] = int((tokens == reference).all(dim=0).sum().item())
                row["greedy_tokens"] = int(tokens.shape[1])
            except Exception as exc:  # the other rows still run
                row = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            if row.get("step_ms"):
                row["roofline_fraction"] = record["roofline_step_ms"] / row["step_ms"]
            row["seconds"] = round(time.perf_counter() - t0, 1)
            record["rows"][f"{weights}/{method}"] = row
            print(json.dumps({f"{weights}/{method}": {k: v for k, v in row.items() if k != "top"}}), flush=True)
            for r in row.get("top", [])[:15]:
                print(f"  {r['us_per_step']:9.1f} us  x{r['per_step']:<6g} {r['group']:<20} {r['kernel'][:90]}",
                      flush=True)
            engine = None
            if weights == "neuzip-lossless":
                from neutrain.decode.zgemv import detach_zgemv

                detach_zgemv(model)
        model = None
        free(device)
    record["targets"] = profile_targets(record["rows"], record["roofline_step_ms"])
    text = json.dumps(record, indent=1)
    (out / "decode_profile.json").write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "decode_profile.json").write_text(text)
    return record


if __name__ == "__main__":
    main()
