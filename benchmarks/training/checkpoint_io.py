"""Where a compressed checkpoint's save, check, load and NeuZip export spend their time, on the CPU.

A Llama built from a config (nothing downloads), compressed losslessly, then each I/O stage timed on its
own, best of ``--repeats``: the checkpoint's write, its manifest, the check a resume and an export run
first (:func:`neutrain.storage.manifest.verify_checkpoint`), the load of its blobs, and a NeuZip export
with its manifest. The 70B's stages scale with the bytes (89 GiB against the ~1 GiB here), so the
seconds per GiB are printed beside the seconds. benchmarks/offload/NOTES.md reads them.

    python benchmarks/training/checkpoint_io.py --layers 8 --hidden 2048 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import neutrain
    from neutrain.export.neuzip import export_neuzip
    from neutrain.nn import compress_model
    from neutrain.nn.checkpoint import load_compressed_state, save_compressed_checkpoint
    from neutrain.storage.manifest import verify_checkpoint, write_manifest

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=args.hidden // 128, num_key_value_heads=args.hidden // 128, vocab_size=32000)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    compress_model(model, progress=False)
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="checkpoint-io-"))
    checkpoint, export = scratch / "checkpoint", scratch / "export"

    def save():
        shutil.rmtree(checkpoint, ignore_errors=True)
        save_compressed_checkpoint(model, checkpoint, "neuzip-lossless")
        write_manifest(checkpoint)

    def save_only():
        shutil.rmtree(checkpoint, ignore_errors=True)
        save_compressed_checkpoint(model, checkpoint, "neuzip-lossless")

    def export_only():
        export_neuzip(model, export, overwrite=True)

    times = {"save_and_manifest": _best(save, args.repeats), "save": _best(save_only, args.repeats)}
    times["manifest"] = _best(lambda: write_manifest(checkpoint), args.repeats)  # the file as just written
    times["verify"] = _best(lambda: verify_checkpoint(checkpoint), args.repeats)
    times["load"] = _best(lambda: load_compressed_state(model, checkpoint), args.repeats)
    times["export_neuzip"] = _best(export_only, args.repeats)
    gib = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file()) / 2**30
    record = {"neutrain": os.path.dirname(neutrain.__file__), "checkpoint_gib": round(gib, 3), "cpus": os.cpu_count(),
              "seconds": {k: round(v, 3) for k, v in times.items()},
              "seconds_per_gib": {k: round(v / gib, 2) for k, v in times.items()}}
    print(json.dumps(record, indent=1))
    if args.dir is None:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
