"""Peak memory and throughput of full fine-tuning, Llama-3-8B architecture, one GPU.

Variants, each in a fresh subprocess so the allocator starts clean:

    a  dense + AdamW through the Hugging Face Trainer (OOM is a result)
    b  dense + SGD with full gradients
    c  dense + fused LOMO
    d  NeuZip lossless + fused LOMO
    e  NeuZip lossless + AdaLomo
    f  dense + AdaLomo (neutrain's fused AdaLomo on dense weights: the peer of e)
    g  as d, with the decode buffers NOT reserved up front (the allocator A/B)
    h  peer: Hugging Face Trainer, optim="lomo"
    p  peer: Hugging Face Trainer, optim="paged_adamw_8bit" (bitsandbytes)
    t  peer: torchao AdamW8bit stepped in backward, one optimizer per parameter (torchtune)

Random init, sequence 1024, bf16, activation checkpointing on. Memory at batch 1;
throughput at batch 8 (and batch 1). Each row carries peak allocated/reserved GiB,
the device's used memory (NVML, or cudaMemGetInfo), tokens/s (CUDA events, median after
warm-up) and the planner's estimate; batch-1 rows carry the allocator's segment map, and
``--profile`` variants a profiled batch-8 step (top kernels, host syncs). The JSON's
``targets`` are the memory and speed goals of :func:`targets_of`. Peers live in ``benchmarks/memory/_train_peers.py``.

    python benchmarks/memory/train_memory.py                    # all variants, writes benchmarks/memory/results.jsonl#train_memory
    python benchmarks/memory/train_memory.py --tiny --variants c,d   # CPU/GPU smoke test on a tiny model
    python benchmarks/memory/train_memory.py --variants d,c --clip-mode global_stale --name train_memory_stale

``--clip-mode`` sets the fused optimizers' clipping (threshold 1.0; default per_tensor): under
global_stale the streamed lm_head update runs in one pass from step 2 on (no second lm_head
gradient pass); the first two steps are warm-up either way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
VARIANTS = {
    "a": ("dense", "adamw-hf"), "b": ("dense", "sgd"), "c": ("dense", "lomo"),
    "d": ("neuzip-lossless", "lomo"), "e": ("neuzip-lossless", "adalomo"),
    "f": ("dense", "adalomo"), "g": ("neuzip-lossless", "lomo"),
    "h": ("dense", "lomo-hf"),  # Hugging Face's own optim="lomo" (pip lomo-optim), the comparison the issue names
    "p": ("dense", "paged-adamw8bit-hf"), "t": ("dense", "adamw8bit-torchao-bwd"),
    "q": ("neuzip-lossless", "lomo"),  # d with the side-stream decode-ahead on (neutrain.nn.prefetch)
    "x": ("dense", "lomo"),  # c with the eager update instead of the fused_update kernel (NEUTRAIN_FUSED_UPDATE=0)
}
PEERS = ("h", "p", "t", "f")  # what a user would pick instead
# neutrain's own code paths run with the allocator setting `neutrain train` sets by default
# (cli/main.py); the Hugging Face, torchao and bitsandbytes peers keep torch's default.
NEUTRAIN_ALLOC_CONF = "expandable_segments:True"
PEER_CODE = ("h", "p", "t", "a", "b")
HF_OPTIM = {"adamw-hf": "adamw_torch", "lomo-hf": "lomo", "paged-adamw8bit-hf": "paged_adamw_8bit"}


def run_variant(key: str, tiny: bool, seq: int, batches: list[int], steps: int, profile: bool = False,
                clip_mode: str = "per_tensor") -> dict:
    """One variant in this process: build, train a few steps per batch size, measure."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from benchmarks.memory import _train_peers as peers

    idle_gib = peers.device_used_gib()  # before this process touches the GPU: the card's own floor

    from neutrain.memory import ModelShape, estimate

    weights, opt_name = VARIANTS[key]
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    config = LlamaConfig(**(TINY if tiny else LLAMA3_8B))
    config._attn_implementation = "sdpa"
    t0 = time.perf_counter()
    if weights == "dense":
        with torch.device(device):  # initialised in place on the GPU, N(0, 0.02) like init_compressed
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    else:
        from neutrain.nn.load import init_compressed

        model, _ = init_compressed(config, weights, device, dtype=torch.bfloat16, progress=False)
        if key == "g":  # the A/B: buffers grown on demand and the large one freed after use, as before
            from neutrain.nn import DECODE_BUFFERS

            DECODE_BUFFERS.clear()
        if key == "q":
            from neutrain.nn import PREFETCHER

            PREFETCHER.enabled = True
    build_s = time.perf_counter() - t0
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    from neutrain.nn import causal_lm_loss

    if opt_name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    elif opt_name in ("lomo", "adalomo"):
        from neutrain.optim import optimizer_spec

        rule = optimizer_spec(opt_name).resolve()
        opt = rule(model.parameters(), lr=1e-4, clip_mode=clip_mode, max_grad_norm=1.0).bind(model)
    result: dict = {"variant": key, "weights": weights, "optimizer": opt_name, "build_s": round(build_s, 1),
                    "device_used_idle_gib": idle_gib}
    if opt_name in ("lomo", "adalomo"):
        result["clip_mode"] = clip_mode
    if opt_name in HF_OPTIM:
        (batch,) = batches  # one Trainer per process: LOMO's gradient hooks would stack
        row = peers.guarded(lambda: peers.hf_trainer_peer(model, config.vocab_size, seq, batch, steps, HF_OPTIM[opt_name]))
        return {**result, f"batch{batch}": row}
    if opt_name == "adamw8bit-torchao-bwd":
        return {**result, **peers.torchao_bwd_peer(model, config.vocab_size, seq, batches, steps, profile)}

    def step(batch: int):
        ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
        loss = causal_lm_loss(model, ids, ids)
        if opt_name == "sgd":
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            opt.backward(loss)
            opt.step()
        return loss

    def decode_counts() -> tuple[int, ...]:
        """Synchronous decodes, decodes ahead launched and used, cycles off the recorded order."""
        from neutrain.nn import DECODE_BUFFERS, PREFETCHER, compressed_weights

        return (sum(w.decodes for w in compressed_weights(model)), PREFETCHER.launched,
                DECODE_BUFFERS.prefetch_hits, PREFETCHER.mismatches)

    for batch in batches:
        try:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            counts = decode_counts() if weights != "dense" else None
            times = []
            for i in range(steps):
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                t = time.perf_counter()
                loss = step(batch)
                if cuda:
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) / 1e3)
                else:
                    times.append(time.perf_counter() - t)
            warm = times[2:] if len(times) > 3 else times[1:]
            med = sorted(warm)[len(warm) // 2]
            row = {"tokens_per_s": batch * seq / med, "step_s": med, "loss": float(loss)}
            if counts is not None:
                row["decodes_per_step"] = dict(zip(("sync", "ahead_launched", "ahead_used", "mismatched_cycles"),
                                                   ((b - a) / steps for a, b in zip(counts, decode_counts()))))
            if cuda:
                row.update(peers.memory_row())
                if batch == 1:
                    row["segment_map"] = peers.segment_map()
                if profile and batch == max(batches):
                    row["profile"] = peers.profile_step(lambda: step(batch))
        except torch.OutOfMemoryError as exc:
            row = {"oom": True, "error": str(exc).splitlines()[0][:200]}
            opt.zero_grad(set_to_none=True) if hasattr(opt, "zero_grad") else None
            torch.cuda.empty_cache()
        est = estimate(ModelShape.from_config(config), batch=batch, seq=seq, weights=weights, optimizer=opt_name,
                       checkpointing=True, chunked_loss=True)
        row["planner_gib"] = est.total_gib
        row["planner_reserved_gib"] = est.reserved / 2**30
        row["planner_device_gib"] = est.device / 2**30  # this process's: NVML also shows the card's idle floor
        row["planner_terms_gib"] = {k: v / 2**30 for k, v in est.terms.items()}
        result[f"batch{batch}"] = row
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="d,c,t,e,f,h,p,g,b,a", help="most important first: partial runs keep them")
    ap.add_argument("--tiny", action="store_true", help="tiny model (smoke test)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--profile", default="c,t", help="variants whose largest-batch step is also profiled")
    ap.add_argument("--clip-mode", default="per_tensor", choices=("none", "per_tensor", "global_stale", "global_exact"),
                    help="clipping of neutrain's fused optimizers (max_grad_norm 1.0)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--name", default="train_memory")
    ap.add_argument("--timeout", type=float, default=240, help="seconds per child process")
    ap.add_argument("--budget", type=float, default=0, help="seconds for the whole run; later variants are skipped")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        res = run_variant(args.child, args.tiny, args.seq, batches, args.steps, args.child in args.profile.split(","),
                          args.clip_mode)
        print("RESULT " + json.dumps(res))
        return 0
    from benchmarks._common import git_provenance

    git_provenance()  # fail now, not after the measurement, if the commit cannot be recorded
    rows, began = [], time.perf_counter()
    for key in args.variants.split(","):
        # The Trainer peers get one process per batch size; "g" (the allocator A/B) is a batch-1 question.
        runs = [[b] for b in batches] if VARIANTS[key][1] in HF_OPTIM else [[1]] if key == "g" else [batches]
        row: dict = {"variant": key}
        t = time.perf_counter()
        for run in runs:
            if args.budget and time.perf_counter() - began > args.budget:
                row.setdefault("skipped", []).append(f"batch {run}: over --budget {args.budget:.0f} s")
                continue
            row.update(_child(args, key, run))
        row["wall_s"] = round(time.perf_counter() - t, 1)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("stderr",)}, default=str)[:700], flush=True)
        _write(args, rows)  # after every variant, so a cut-off run keeps what it measured
    _print_table(rows)
    return 0


def _child(args, key: str, batches: list[int]) -> dict:
    cmd = [sys.executable, __file__, "--child", key, "--seq", str(args.seq), "--steps", str(args.steps),
           "--batches", ",".join(map(str, batches)), "--profile", args.profile, "--clip-mode", args.clip_mode]
    cmd += ["--tiny"] if args.tiny else []
    env = dict(os.environ)
    if key not in PEER_CODE:
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", NEUTRAIN_ALLOC_CONF)
    if key == "x":
        env["NEUTRAIN_FUSED_UPDATE"] = "0"
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line:
            return {**json.loads(line[7:]), "alloc_conf": env.get("PYTORCH_CUDA_ALLOC_CONF")}
        return {"variant": key, "failed": True, f"stderr_batch{batches[0]}": proc.stderr[-1500:]}
    except subprocess.TimeoutExpired:
        return {"variant": key, "failed": True, f"timeout_batch{batches[0]}_s": args.timeout}


def _rounds(rows: list[dict], key: str, batch: int) -> list[float]:
    """Every measured tokens/s of variant ``key`` at ``batch``, one per process that ran it (in order)."""
    return [r[f"batch{batch}"]["tokens_per_s"] for r in rows
            if r["variant"] == key and r.get(f"batch{batch}", {}).get("tokens_per_s")]


def _tps(rows: list[dict], key: str, batch: int) -> float | None:
    """The median over the variant's processes. Why rounds: at batch 1 both steps wait on the host, whose speed
    drifts within a call (dense batch 1 took 276-461 ms over one session's calls); ``--variants d,c,c,d`` times
    each twice, in an order that cancels a steady drift."""
    got = _rounds(rows, key, batch)
    return statistics.median(got) if got else None


def targets_of(rows: list[dict]) -> dict:
    """The memory and speed targets (fixed names) from the rows measured; a missing input leaves its target out.

    A variant listed more than once is measured once a process; its throughput is the median over them and the
    ratio's entry lists each round's values.
    """
    out: dict = {}

    def ratio(name, num, den, goal, keys=None, batch=None, **extra):
        if num and den:
            out[name] = {"value": round(num / den, 3), "goal": goal, "met": num / den >= float(goal.split()[-1]), **extra}
            if keys and any(len(_rounds(rows, k, batch)) > 1 for k in keys):
                out[name]["rounds_tokens_per_s"] = {k: _rounds(rows, k, batch) for k in keys}

    def pair(name, a, b, batch, goal):
        ratio(name, _tps(rows, a, batch), _tps(rows, b, batch), goal, keys=(a, b), batch=batch)

    peers = {k: _tps(rows, k, 8) for k in PEERS if _tps(rows, k, 8)}
    best = max(peers, key=peers.get) if peers else None
    pair("d_over_c_tokens_per_s_batch8", "d", "c", 8, ">= 0.97")
    pair("d_over_c_tokens_per_s_batch1", "d", "c", 1, ">= 0.95")
    if best:
        note = {"best_peer": f"{best} ({VARIANTS[best][1]})", "peers_tokens_per_s_batch8": peers}
        ratio("c_over_best_peer_tokens_per_s_batch8", _tps(rows, "c", 8), peers[best], ">= 1.0", **note)
        ratio("d_over_best_peer_tokens_per_s_batch8", _tps(rows, "d", 8), peers[best], ">= 0.92", **note)
    pair("e_over_dense_adalomo_batch8", "e", "f", 8, ">= 0.85")
    for name, field, goal in (("d_device_used_gib_batch1", "device_used_gib", 14.5),
                              ("d_peak_reserved_gib_batch1", "peak_reserved_gib", 12.1)):
        seen = [r["batch1"][field] for r in rows if r["variant"] == "d" and r.get("batch1", {}).get(field) is not None]
        if seen:  # the worst of the rounds: memory is a bound, not a typical value
            out[name] = {"value": round(max(seen), 3), "goal": f"<= {goal}", "met": max(seen) <= goal}
    reserved_errors = [abs(r[b]["planner_reserved_gib"] - r[b]["peak_reserved_gib"]) / r[b]["peak_reserved_gib"]
                       for r in rows for b in ("batch1", "batch8")
                       if "planner_reserved_gib" in r.get(b, {}) and "peak_reserved_gib" in r[b]
                       and VARIANTS[r["variant"]][0] != "dense"]
    if reserved_errors:
        out["planner_reserved_max_relative_error"] = {
            "value": round(max(reserved_errors), 4), "goal": "<= 0.10", "met": max(reserved_errors) <= 0.10,
            "derived_from": "compressed variants: max |planner_reserved_gib - peak_reserved_gib| / peak_reserved_gib"}
    errors = [abs(r[b]["planner_gib"] - r[b]["peak_allocated_gib"]) / r[b]["peak_allocated_gib"]
              for r in rows for b in ("batch1", "batch8") if "planner_gib" in r.get(b, {}) and "peak_allocated_gib" in r[b]]
    if errors:
        out["planner_max_relative_error"] = {"value": round(max(errors), 4), "goal": "<= 0.10", "met": max(errors) <= 0.10,
                                             "derived_from": "max over variants of |planner_gib - peak_allocated_gib| / peak_allocated_gib"}
    return out


def _print_table(rows: list[dict]) -> None:
    print(f"{'var':4} {'optimizer':24} {'b8 tok/s':>9} {'b1 tok/s':>9} {'b1 alloc':>9} {'b1 resv':>8} {'b1 dev':>7}")
    for r in rows:
        b1, b8 = r.get("batch1", {}), r.get("batch8", {})
        f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
        print(f"{r['variant']:4} {VARIANTS[r['variant']][1]:24} {f(b8.get('tokens_per_s'), 0):>9} {f(b1.get('tokens_per_s'), 0):>9} "
              f"{f(b1.get('peak_allocated_gib')):>9} {f(b1.get('peak_reserved_gib')):>8} {f(b1.get('device_used_gib')):>7}")
    for name, t in targets_of(rows).items():
        print(f"target {name} = {t['value']} (goal {t['goal']}, met {t['met']})")


def _write(args, rows) -> None:
    from benchmarks._common import write_result

    write_result(args.name, {"seq": args.seq, "steps": args.steps, "batches": args.batches, "tiny": args.tiny,
                             "model": "tiny" if args.tiny else "llama3-8b", "activation_checkpointing": True,
                             "dtype": "bfloat16", "clip_mode": args.clip_mode, "max_grad_norm": 1.0,
                             "alloc_conf": {"neutrain": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", NEUTRAIN_ALLOC_CONF),
                                            "peers": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")},
                             "decode_buffers": "reserved up front (DecodeBuffers.reserve) except variant g"},
                 {"variants": rows}, targets=targets_of(rows))


if __name__ == "__main__":
    raise SystemExit(main())
