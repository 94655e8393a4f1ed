"""What a user would run instead of neutrain, for ``train_memory.py``, and its probes.

Peers, each on the plain Hugging Face model and loss (``model(input_ids, labels=...).loss``),
activation checkpointing on, bf16 weights:

* ``lomo-hf``: the Hugging Face ``Trainer`` with ``optim="lomo"`` (pip ``lomo-optim``);
* ``paged-adamw8bit-hf``: the ``Trainer`` with ``optim="paged_adamw_8bit"`` (bitsandbytes);
* ``adamw8bit-torchao-bwd``: torchao's ``AdamW8bit``, one optimizer per parameter stepped in a
  ``register_post_accumulate_grad_hook`` (torchtune's single-device full fine-tune with
  ``optimizer_in_bwd``), driven by a plain loop.

Every peer's step is timed with CUDA events after warm-up (median), and its memory read three
ways: peak allocated, peak reserved, device used (NVML). The probes: the allocator's segment map
(:func:`segment_map`) and a profiled step (:func:`profile_step`: top kernels, host syncs).
"""

from __future__ import annotations

import tempfile
import time
from statistics import median
from typing import Any, Callable

import torch


def device_used_gib() -> float | None:
    """The device's used memory as NVML reports it (what another process could not have), as the trainer's
    phase records read it.

    Through torch, which maps the CUDA index to NVML's through ``CUDA_VISIBLE_DEVICES``: NVML numbers
    every GPU of the host, so NVML's own index 0 is another card than ``cuda:0`` when a run is given
    the second GPU (two benchmarks side by side then each read the other's memory)."""
    from neutrain.memory import device_memory_used

    if not torch.cuda.is_available():
        return None
    return device_memory_used(torch.cuda.current_device() if torch.cuda.is_initialized() else 0) / 2**30


def memory_row() -> dict[str, float | None]:
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30, "device_used_gib": device_used_gib()}


def timed_steps(step: Callable[[], Any], steps: int) -> tuple[float, Any]:
    """Median seconds per step (CUDA events; the first two steps are warm-up) and the last result."""
    times, out = [], None
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    warm = times[2:] if len(times) > 3 else times[1:]
    return float(median(warm)), out


def segment_map(top: int = 8) -> dict[str, Any]:
    """The caching allocator's segments now (segments only grow, so these are the ones at peak reserved).

    Per pool (large/small): segment count and bytes; then the largest segments with their allocated
    bytes and largest free block, which shows where reserved exceeds allocated.
    """
    segments = torch.cuda.memory_snapshot()
    pools: dict[str, dict[str, float]] = {}
    for seg in segments:
        pool = pools.setdefault(seg.get("segment_type", "?"), {"segments": 0, "reserved_gib": 0.0, "allocated_gib": 0.0})
        pool["segments"] += 1
        pool["reserved_gib"] += seg["total_size"] / 2**30
        pool["allocated_gib"] += seg["allocated_size"] / 2**30
    largest = sorted(segments, key=lambda s: -s["total_size"])[:top]
    rows = []
    for seg in largest:
        free = [b["size"] for b in seg["blocks"] if b["state"] == "inactive"]
        rows.append({"mib": round(seg["total_size"] / 2**20, 1), "allocated_mib": round(seg["allocated_size"] / 2**20, 1),
                     "blocks": len(seg["blocks"]), "largest_free_mib": round(max(free, default=0) / 2**20, 1)})
    sizes = sorted(s["total_size"] for s in segments)
    return {"pools": {k: {n: round(v, 3) for n, v in p.items()} for k, p in pools.items()}, "largest_segments": rows,
            "segment_mib_histogram": _histogram(sizes)}


def _histogram(sizes: list[int]) -> dict[str, int]:
    edges = [2, 20, 128, 512, 1024, 4096]
    out: dict[str, int] = {}
    for size in sizes:
        mib = size / 2**20
        label = next((f"<={e}" for e in edges if mib <= e), f">{edges[-1]}")
        out[label] = out.get(label, 0) + 1
    return out


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def is_host_sync(name: str) -> bool:
    """Whether a profiler event of this name is a CUDA runtime call that makes the host wait."""
    return name.startswith(SYNC_CALLS) and not name.startswith("cudaMemcpyAsync")


def profile_step(step: Callable[[], Any], top: int = 12) -> dict[str, Any]:
    """One step under torch.profiler: the top kernels by device time and the host-sync calls."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    syncs: dict[str, int] = {}
    for ev in prof.events():
        name = ev.name
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(name[:90], [0.0, 0])
            entry[0] += ev.device_time / 1e3
            entry[1] += 1
        elif is_host_sync(name):
            syncs[name] = syncs.get(name, 0) + 1
    if syncs.get("cudaDeviceSynchronize"):
        syncs["cudaDeviceSynchronize"] -= 1  # the profiler's own closing synchronize
    total = sum(v[0] for v in kernels.values())
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return {"device_ms_total": round(total, 1), "host_syncs": syncs, "host_sync_count": sum(syncs.values()),
            "top_kernels": [{"name": n, "ms": round(v[0], 2), "calls": v[1], "share": round(v[0] / total, 3)}
                            for n, v in ranked]}


def torchao_bwd_peer(model, vocab: int, seq: int, batches: list[int], steps: int, profile: bool) -> dict:
    """torchao AdamW8bit stepped inside backward, one optimizer per parameter (torchtune's setting)."""
    from torchao.optim import AdamW8bit

    optimizers = {p: AdamW8bit([p], lr=1e-5) for p in model.parameters() if p.requires_grad}

    def hook(p):
        optimizers[p].step()
        optimizers[p].zero_grad(set_to_none=True)

    for p in optimizers:
        p.register_post_accumulate_grad_hook(hook)

    def make_step(batch):
        def step():
            ids = torch.randint(0, vocab, (batch, seq), device="cuda")
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            return loss
        return step

    out: dict = {}
    for batch in batches:
        out[f"batch{batch}"] = guarded(lambda: _measure(make_step(batch), batch, seq, steps, profile and batch == max(batches)))
    return out


def _measure(step, batch: int, seq: int, steps: int, profile: bool) -> dict:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step_s, loss = timed_steps(step, steps)
    row = {"tokens_per_s": batch * seq / step_s, "step_s": step_s, "loss": float(loss), **memory_row()}
    if batch == 1:
        row["segment_map"] = segment_map()
    if profile:
        row["profile"] = profile_step(step)
    return row


def guarded(fn: Callable[[], dict]) -> dict:
    """``fn()``, or an ``oom`` row if the card ran out of memory (itself a result)."""
    try:
        return fn()
    except torch.OutOfMemoryError as exc:
        torch.cuda.empty_cache()
        return {"oom": True, "error": str(exc).splitlines()[0][:200], **memory_row()}


def hf_trainer_peer(model, vocab: int, seq: int, batch: int, steps: int, optim: str) -> dict:
    """The ordinary Hugging Face Trainer with ``optim`` (one batch size per process: LOMO hooks stay)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from neutrain.compat import checkpointing_training_args

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 1 << 16

        def __getitem__(self, i):
            ids = torch.randint(0, vocab, (seq,))
            return {"input_ids": ids, "labels": ids}

    class StepTimer(TrainerCallback):
        """CUDA events around each optimizer step (forward, backward and update)."""

        def __init__(self):
            self.pairs: list[tuple] = []

        def on_step_begin(self, *a, **k):
            self.pairs.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self.pairs[-1][0].record()

        def on_step_end(self, *a, **k):
            self.pairs[-1][1].record()

    timer = StepTimer()
    args = TrainingArguments(tempfile.mkdtemp(), per_device_train_batch_size=batch, max_steps=steps, optim=optim,
                             bf16=True, logging_steps=10**6, report_to="none", save_strategy="no", learning_rate=1e-5,
                             dataloader_num_workers=0, **checkpointing_training_args(True))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[timer]).train()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) / 1e3 for s, e in timer.pairs]
    warm = times[2:] if len(times) > 3 else times[1:]
    step_s = float(median(warm))
    row = {"tokens_per_s": batch * seq / step_s, "step_s": step_s, "wall_tokens_per_s": steps * batch * seq /
           (time.perf_counter() - t), **memory_row()}
    if batch == 1:
        row["segment_map"] = segment_map()
    return row
