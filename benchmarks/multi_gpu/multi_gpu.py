"""Fused-update training on 1, 2 and 4 GPUs: per-GPU peak memory and tokens/s per GPU, per mode.

One process per GPU, started by ``torchrun``; each run is one mode at one GPU
count, and rank 0 writes ``multi_gpu_<mode>_<n>gpu.json`` as soon as it ends,
so a failing mode never loses the others' results. ``--summarize`` prints the
runs merged, with scaling efficiency against the 1-GPU run; ``--summarize --write``
also writes them to ``multi_gpu.json`` (with the runs' own device and commit).

Setting (the NeuZip/LOMO papers' 8B setting): Llama-3-8B architecture, random init
(directly on the GPU in bf16, or sharded from the meta device), sequence 1024,
``--micro-batch`` sequences per GPU (so the global batch grows with the GPU count, as
data parallelism does), non-reentrant activation checkpointing, fused LOMO
updates (bf16 weights, stochastic rounding), the model's own loss. Modes:

* ``single``: one GPU, no communication (the reference for scaling);
* ``replicated``: every GPU holds the whole model; gradients averaged by one
  asynchronous all-reduce each (:mod:`neutrain.distributed.data_parallel`);
* ``fsdp2``: ``fully_shard`` per decoder layer and root; updates on local shards;
* ``zero3``: DeepSpeed ZeRO-3, engine without an optimizer (needs ``deepspeed``).

Timing: ``--warmup`` untimed steps, then ``--steps`` timed ones (wall time per
step, CUDA-synchronised, the slowest rank's). Memory: peak allocated/reserved
during the timed steps (after setup), the largest over ranks; plus the peak
during setup.

Usage (one 4-GPU machine)::

    torchrun --nproc_per_node 1 benchmarks/multi_gpu/multi_gpu.py --mode single
    torchrun --nproc_per_node 4 benchmarks/multi_gpu/multi_gpu.py --mode fsdp2
    python benchmarks/multi_gpu/multi_gpu.py --summarize                          # prints the rows
    python benchmarks/multi_gpu/multi_gpu.py --summarize --write --results-dir "$OUT"   # and writes multi_gpu.json there
    # CPU dry run of the code paths (gloo, tiny model):
    torchrun --nproc_per_node 2 benchmarks/multi_gpu/multi_gpu.py --mode replicated --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks._common import git_provenance, write_result  # noqa: E402

# Profiles go beside the runs' files ($OUT on the device machine), else here.
SCRATCH = Path("/tmp/neutrain-multi-gpu")

MODES = ("single", "replicated", "fsdp2", "zero3")
LLAMA3_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=MODES)
    p.add_argument("--tiny", action="store_true", help="tiny Llama on CPU with gloo (dry run of every code path)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 1024; 64 with --tiny)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per GPU per step (default 4; 2 with --tiny)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--optimizer", default="lomo", choices=("lomo", "adamw-in-backward", "adalomo"))
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--no-checkpointing", action="store_true")
    p.add_argument("--max-inflight", type=int, default=2,
                   help="zero3: reduce-scatters in flight while backward goes on (0: each one before backward continues; "
                        "written as an ablation file, outside the summary)")
    p.add_argument("--tensor-norms", action="store_true",
                   help="zero3/fsdp2 ablation: sum every tensor's squared norm over the shards at once (one collective "
                        "per tensor), as clipping per tensor needs, instead of once per step")
    p.add_argument("--zero3-options", default="{}", help="zero3: JSON merged into zero_optimization "
                   "(e.g. '{\"stage3_prefetch_bucket_size\": 5e8}'); a non-empty value is written as an ablation file")
    p.add_argument("--profile", type=int, default=0, help="after timing, profile this many steps (torch.profiler); "
                   "rank 0 writes the top CUDA kernels to <result>_profile.txt")
    p.add_argument("--summarize", action="store_true", help="print the runs of multi_gpu_*.json merged into rows")
    p.add_argument("--write", action="store_true", help="with --summarize: also write them to multi_gpu.json in "
                   "--results-dir (never over a file git tracks: a committed record is replaced by a deliberate commit)")
    p.add_argument("--results-dir", default=os.environ.get("OUT") or None)
    args = p.parse_args(argv)
    if not args.summarize and args.mode is None:
        p.error("--mode is required unless --summarize")
    args.seq = args.seq or (64 if args.tiny else 1024)
    args.micro_batch = args.micro_batch or (2 if args.tiny else 4)
    return args


# ----------------------------------------------------------------------------- setup


def init_distributed(tiny: bool) -> tuple[int, int, torch.device]:
    if "RANK" not in os.environ:  # plain `python benchmarks/multi_gpu/multi_gpu.py --mode single`
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29599")
    local_rank = int(os.environ["LOCAL_RANK"])
    if tiny or not torch.cuda.is_available():
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    return dist.get_rank(), dist.get_world_size(), device


def enable_checkpointing(model) -> None:
    # transformers 5.2x renamed gradient_checkpointing_enable (5.17 knows only the old name).
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    key = "activation_checkpointing_kwargs" if enable.__name__.startswith("activation") else "gradient_checkpointing_kwargs"
    enable(**{key: {"use_reentrant": False}})


@torch.no_grad()
def random_init_(model, device: torch.device, config, seed: int = 0) -> None:
    """Fill weights in place (normal(0, 0.02), norms 1) and rebuild the rotary buffers for ``device``.

    Much faster than ``from_config``'s per-module init on 8B parameters; works on
    FSDP2 shards (each rank fills its local shard). Same seed on every rank.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p.data
        if local.dim() == 1:
            local.fill_(1.0)
        else:
            local.normal_(0.0, 0.02, generator=gen)
    rotary = model.model.rotary_emb
    with torch.device(device):  # (transformers versions differ on a `device` argument)
        model.model.rotary_emb = type(rotary)(config=config)


def build_model(args, mode: str, device: torch.device, world: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**(TINY if args.tiny else LLAMA3_8B))
    dtype = torch.bfloat16
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    model.to_empty(device=device)
    random_init_(model, device, config)
    if not args.no_checkpointing:
        enable_checkpointing(model)
    model.train()
    return model, config


def build(args, mode: str, device: torch.device, world: int):
    """Model, optimizer and a ``train_step(ids)``, for ``mode``."""
    from neutrain.distributed.shards import PARAMETER_SHARDS
    from neutrain.optim import build_fused_optimizer

    model, config = build_model(args, mode, device, world)
    sharding = PARAMETER_SHARDS if mode in ("fsdp2", "zero3") else None  # each rank updates its own shards
    opt = build_fused_optimizer(model, args.optimizer, lr=args.lr, stochastic_rounding=True, seed=0, sharding=sharding)
    counters = {}
    if mode == "replicated":
        from neutrain.distributed.data_parallel import attach

        counters["sync"] = attach(opt, model)
    engine = None
    if mode == "zero3":
        from neutrain.distributed.deepspeed import initialize_zero3

        ds_config = {"train_micro_batch_size_per_gpu": args.micro_batch,
                     "zero_optimization": {"stage": 3, **json.loads(args.zero3_options)},
                     "bf16": {"enabled": device.type == "cuda"}}
        engine = initialize_zero3(model, opt, ds_config, max_inflight=args.max_inflight)
    if mode in ("fsdp2", "zero3"):
        assert opt.shards, f"{mode}: no parameter of the optimizer is a shard"
        if args.tensor_norms:
            opt.shards.common_group = None  # ablation: never defer the per-tensor norm collectives

    def train_step(ids):
        if engine is not None:
            from neutrain.distributed.deepspeed import backward

            backward(engine, opt, engine.module(input_ids=ids, labels=ids).loss)
        else:
            opt.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()

    return model, opt, train_step, counters, config


# ----------------------------------------------------------------------------- measure


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reduce_max(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def run(args) -> dict:
    rank, world, device = init_distributed(args.tiny)
    mode = args.mode
    if mode == "single" and world != 1:
        raise SystemExit("--mode single runs on 1 process")
    if mode != "single" and world < 2:
        raise SystemExit(f"--mode {mode} needs at least 2 processes")
    t0 = time.perf_counter()
    model, opt, train_step, counters, config = build(args, mode, device, world)
    _sync(device)
    setup_s = time.perf_counter() - t0
    setup_peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    gen = torch.Generator().manual_seed(1000 + rank)  # every rank its own data, like a sharded data loader

    def batch():
        return torch.randint(0, config.vocab_size, (args.micro_batch, args.seq), generator=gen).to(device)

    for _ in range(args.warmup):
        train_step(batch())
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        ids = batch()
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        train_step(ids)
        _sync(device)
        times.append(time.perf_counter() - start)
    times = _reduce_max(times, device)  # a step ends when the slowest rank ends
    peak = reserved = float("nan")
    if device.type == "cuda":
        peak, reserved, setup_peak = _reduce_max(
            [torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30,
             setup_peak], device)
    step_s = median(times)
    tokens_per_gpu = args.micro_batch * args.seq
    result = {
        "mode": mode, "gpus": world, "step_time_s": step_s, "step_times_s": times,
        "tokens_per_s_per_gpu": tokens_per_gpu / step_s, "tokens_per_s_total": world * tokens_per_gpu / step_s,
        "peak_allocated_gib_per_gpu": peak, "peak_reserved_gib_per_gpu": reserved,
        "setup_peak_allocated_gib_per_gpu": setup_peak, "setup_s": setup_s,
        "parameters": sum(int(getattr(p, "ds_numel", 0)) or p.numel() for p in model.parameters()),
        "sharded_tensors": len(opt.shards), "grad_norm_last": opt.grad_norm(),
    }
    if "sync" in counters:
        result["all_reduces"] = counters["sync"].completed
    if opt.partition_sync is not None:
        result["async_reduce_scatters"] = opt.partition_sync.completed
    if args.profile:
        result["profile_file"] = _profile(args, train_step, batch, device, rank, mode, world)
    if rank == 0:
        settings = {k: getattr(args, k) for k in ("tiny", "seq", "micro_batch", "warmup", "steps", "optimizer", "lr",
                                                  "max_inflight", "tensor_norms", "zero3_options")}
        settings.update(model="tiny-llama" if args.tiny else "Llama-3-8B architecture (random init)", dtype="bfloat16",
                        activation_checkpointing=not args.no_checkpointing, backend=dist.get_backend())
        name = f"multi_gpu_{mode}_{world}gpu" + ("_tiny" if args.tiny else "") + _ablation_suffix(args, mode)
        path = write_result(name, settings, result, out_dir=args.results_dir)
        print(json.dumps(result, indent=2))
        print(f"wrote {path}")
    dist.barrier()
    dist.destroy_process_group()
    return result


def _ablation_suffix(args, mode: str) -> str:
    """File-name suffix of a run with non-default ablation settings ("" for the summarized runs)."""
    suffix = f"_inflight{args.max_inflight}" if mode == "zero3" and args.max_inflight != 2 else ""
    suffix += "_tensornorms" if args.tensor_norms else ""
    return suffix + ("_zero3options" if json.loads(args.zero3_options) else "")


def _profile(args, train_step, batch, device, rank: int, mode: str, world: int) -> str | None:
    """Profile ``args.profile`` steps on every rank; rank 0 writes its top CUDA kernels and the NCCL share."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.profile):
            train_step(batch())
        _sync(device)
    if rank != 0:
        return None
    events = prof.key_averages()
    attr = "device_time_total" if hasattr(events[0], "device_time_total") else "cuda_time_total"
    # Device-side rows are kernels plus annotations that span them (``nccl:_all_gather_base`` covers its
    # ncclDevKernel exactly): counting both would count communication twice.
    kernels = [e for e in events if getattr(e, attr, 0) > 0 and getattr(e, "device_type", None) is not None
               and "cuda" in str(e.device_type).lower() and not getattr(e, "is_user_annotation", False)
               and not e.key.startswith("nccl:")]
    total = sum(getattr(e, attr) for e in kernels) or 1.0
    nccl = sum(getattr(e, attr) for e in kernels if "nccl" in e.key.lower())
    lines = [f"{mode} x{world}: {args.profile} steps; CUDA kernel time {total / 1e3:.1f} ms, NCCL {nccl / 1e3:.1f} ms "
             f"({100 * nccl / total:.0f} %) (kernel time sums concurrent streams)", ""]
    for e in sorted(kernels, key=lambda e: -getattr(e, attr))[:25]:
        lines.append(f"{getattr(e, attr) / 1e3:10.1f} ms {e.count:7d}x  {e.key[:110]}")
    path = Path(args.results_dir or SCRATCH) / f"multi_gpu_{mode}_{world}gpu_profile{_ablation_suffix(args, mode)}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:12]))
    return path.name


# ----------------------------------------------------------------------------- summary


PROVENANCE = ("device", "cuda", "versions", "git_commit", "git_dirty")
"""What a merged record takes from the runs it merges: where and from which code they were measured."""


def measured_provenance(payloads: list[dict]) -> dict:
    """The device, versions, commit and date of the runs (the latest run's date); they must agree on device and commit.

    Why: the summary used to record the machine that merged the files (``device: cpu``, today's commit), and
    the multi-GPU table (docs/launching.md) then said "Measured on cpu GPUs".
    """
    for key in ("device", "git_commit"):
        values = sorted({str(p.get(key)) for p in payloads})
        if len(values) > 1:
            raise SystemExit(f"--summarize --write: the runs disagree on {key} ({', '.join(values)}); merge the runs of one sweep")
    return {**{key: payloads[0].get(key) for key in PROVENANCE}, "date": max(str(p.get("date")) for p in payloads)}


def _tracked_by_git(path: Path) -> bool:
    try:
        subprocess.run(["git", "ls-files", "--error-unmatch", path.name], cwd=path.parent, check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return False
    return True


def summarize(results_dir: str | None, tiny: bool = False, write: bool = False) -> Path | None:
    """Print the per-run records merged: rows per mode and GPU count, scaling vs 1 GPU; with ``write``, also write
    them to ``multi_gpu.json`` in ``results_dir`` (its path is returned). Without ``results_dir`` the runs are the
    current rows of the multi_gpu table, and ``write`` is refused.

    A summary never replaces a committed record: merging the committed runs on another machine wrote that
    machine's name and commit into ``multi_gpu.json``. Written, it carries the runs' own provenance and joins the
    table by ``python benchmarks/records.py add``, a deliberate step.
    """
    import re

    from benchmarks import records

    suffix = "_tiny" if tiny else ""
    if results_dir is None:
        if write:  # refused before anything is printed as if it had been written
            raise SystemExit("--write: benchmarks/multi_gpu/results.jsonl is a committed record; write to a "
                             "--results-dir and add the new record deliberately (benchmarks/records.py add)")
        named = re.compile(rf"multi_gpu_[a-z0-9]+_\d+gpu{suffix}")
        payloads = sorted((r for r in records.rows("multi_gpu") if r.get("current") and named.fullmatch(r["name"])),
                          key=lambda r: r["name"])
    else:
        payloads = [json.loads(p.read_text()) for p in sorted(Path(results_dir).glob(f"multi_gpu_*gpu{suffix}.json"))]
    runs = [{**p["results"], "settings": p["settings"], "device": p["device"]} for p in payloads]
    if not runs:
        print(f"no multi_gpu_*gpu{suffix} records in {results_dir or 'benchmarks/multi_gpu/results.jsonl'}")
        return None
    target = Path(results_dir or SCRATCH) / f"multi_gpu{suffix}.json"
    if write and _tracked_by_git(target):
        raise SystemExit(f"--write: {target} is a committed record; write to another --results-dir and commit the "
                         "new record deliberately")
    single = next((r for r in runs if r["mode"] == "single"), None)
    rows = []
    for r in sorted(runs, key=lambda r: (MODES.index(r["mode"]), r["gpus"])):
        row = {k: r[k] for k in ("mode", "gpus", "tokens_per_s_per_gpu", "peak_allocated_gib_per_gpu",
                                 "peak_reserved_gib_per_gpu", "step_time_s", "device")}
        if single is not None:
            row["scaling_efficiency"] = r["tokens_per_s_per_gpu"] / single["tokens_per_s_per_gpu"]
            row["memory_vs_1gpu"] = r["peak_allocated_gib_per_gpu"] / single["peak_allocated_gib_per_gpu"]
        rows.append(row)
    for row in rows:
        print(json.dumps(row))
    print(markdown_table(rows))
    if not write:
        return None
    record = {"name": target.stem, **measured_provenance(payloads),
              "targets_note": "merged by --summarize from the runs' own files", "settings": dict(runs[0]["settings"]),
              "results": rows}
    tmp = target.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2, default=str))
    os.replace(tmp, target)
    print(f"wrote {target}")
    return target


def markdown_table(rows: list[dict]) -> str:
    """The table rows: one per mode and GPU count."""
    lines = ["| mode | GPUs | tokens/s per GPU | scaling vs 1 GPU | peak allocated GiB per GPU | vs 1 GPU | step s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['gpus']} | {r['tokens_per_s_per_gpu']:.0f} | "
                     f"{100 * r.get('scaling_efficiency', float('nan')):.0f} % | {r['peak_allocated_gib_per_gpu']:.2f} | "
                     f"{r.get('memory_vs_1gpu', float('nan')):.2f}x | {r['step_time_s']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.summarize:  # merges what the runs recorded: their provenance, not this checkout's
        summarize(args.results_dir, args.tiny, args.write)
    else:
        git_provenance()  # fail now, not after the measurement, if the commit cannot be recorded
        run(args)


if __name__ == "__main__":
    main()
