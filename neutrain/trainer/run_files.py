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


def host_memory_stats(store=None, spill=None) -> dict[str, float]:
    """Host memory and PCIe bytes of a run so far, for a host-memory budget's record (``summary.json``):

    * ``peak_rss_gib``: the process's peak resident size (the weight store's page-locked arenas are ordinary
      pages, so they count in it);
    * ``host_pinned_peak_gib``: the peak of torch's pinned host allocator (the activation stash's and the
      activation file's staging buffer), which may or may not be counted in the resident size as well: their
      sum is an upper bound of the host memory the run took;
    * ``weight_store_pinned_gib``; ``link_h2d_gib`` / ``link_d2h_gib``: bytes copied each way over PCIe by the
      weight store and the activation stashes (an offloaded input goes out once and comes back once);
    * ``activation_file_written_gib`` / ``activation_file_read_gib``: bytes through the activation file.

    ``store``: the model's weight store (:func:`~neutrain.nn.weight_offload_model.weight_store`), ``spill``: the
    trainer's :class:`~neutrain.nn.activation_file.ActivationFile`; either may be None.

    Example:
        >>> sorted(host_memory_stats())  # no store, no file, no GPU
        ['activation_file_read_gib', 'activation_file_written_gib', 'link_d2h_gib', 'link_h2d_gib', 'peak_rss_gib']
    """
    from neutrain.nn.offload import STATS  # lazy: a run without activation offload never needs it

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"peak_rss_gib": rss / (2**30 if sys.platform == "darwin" else 2**20)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        try:
            out["host_pinned_peak_gib"] = torch.cuda.host_memory_stats().get("allocated_bytes.peak", 0) / 2**30
        except (AttributeError, RuntimeError):  # a torch without the pinned allocator's statistics
            pass
    h2d = d2h = STATS.packed_bytes
    if store is not None:
        out["weight_store_pinned_gib"] = store.pinned_bytes / 2**30
        h2d, d2h = h2d + store.stats.h2d_bytes, d2h + store.stats.d2h_bytes
    out["link_h2d_gib"], out["link_d2h_gib"] = h2d / 2**30, d2h / 2**30
    out["activation_file_written_gib"] = (spill.written_bytes if spill is not None else 0) / 2**30
    out["activation_file_read_gib"] = (spill.read_bytes if spill is not None else 0) / 2**30
    return out


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
