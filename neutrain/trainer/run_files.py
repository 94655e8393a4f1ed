"""What a run writes beside its checkpoints, and the memory figures its logs carry.

Example:
    >>> sorted(peak_memory_stats())  # on a CPU-only machine
    ['peak_rss_gib']
"""

from __future__ import annotations

import os
import resource
import sys

import torch


def peak_memory_stats() -> dict[str, float]:
    """Peak memory so far: GPU allocated/reserved GiB when CUDA is used, else process RSS GiB."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        }
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"peak_rss_gib": rss / (2**30 if sys.platform == "darwin" else 2**20)}


def training_args_as_json(args, output_dir: str) -> None:
    """``training_args.json`` in place of the Trainer's ``training_args.bin``, a pickle of the arguments object."""
    if not args.should_save:
        return
    pickled = os.path.join(output_dir, "training_args.bin")
    if os.path.exists(pickled):
        os.remove(pickled)
    if os.path.isdir(output_dir):
        with open(os.path.join(output_dir, "training_args.json"), "w", encoding="utf-8") as fh:
            fh.write(args.to_json_string())
