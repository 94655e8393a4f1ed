"""The KV-cache benchmark's throughput part: decode tokens/s at long contexts on Llama-3-8B shapes.

Llama-3-8B architecture, random bf16 weights, contexts 32K and 64K. Decode tokens/s at the largest
batch that fits for the full cache (preallocated, in-place writes: the fair baseline; transformers'
DynamicCache would re-copy the whole cache each step), ShadowKV (values in pinned host memory, the
batch sized by GPU memory: overflow rows keep their values on the GPU; its step split by phase with
CUDA events; once unfused, then at the same batch through neutrain/kernels/shadowkv_fused_decode.py, its values
gathered first or read by the kernel where they are stored, and that last step replayed as a CUDA graph against
the full cache's step graphed at each length: benchmarks/kv/_kv_graph.py),
MiniCache (merge, merge + 4-bit, 4-bit only, decoding through the fused kernel of
neutrain/kernels/minicache_attention.py; merge + 4-bit once through the old restore path), a
kvpress-pruned cache and QuantizedCache. This module holds the rows: their order, the batch each is sized to
and what each records. Each row's cache is built by ``_kv_caches`` (random states of the target length, not a
prefill: it says why) and timed by ``_kv_timing``.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import transformers

from benchmarks.kv._kv_caches import (MINICACHE_CHUNK, PinnedBuffer, full_cache, host_buffer_gib, minicache_cache,
                                   prepare_fused, pruned_cache, quantized_cache, release_memory, rewind,
                                   shadowkv_cache)
from benchmarks.kv._kv_graph import MINICACHE_KERNEL_GROUPS, SHADOWKV_KERNEL_GROUPS, PerLengthGraph, graph_against_eager, replay_timeline
from benchmarks.kv._kv_common import DEADLINE, PRESS_RATIO
from benchmarks.kv._kv_plan import MIN_STEPS, TimePlan
from benchmarks.kv._kv_sizing import (GIB, Budget, decode_bytes_per_seq, minicache_transient_bytes_per_seq,
                                   run_with_backoff)
from benchmarks.kv._kv_timing import eager_step, graph_kernel_record, kernel_record, shadowkv_step_split, timed
from neutrain.eval.kv import disable_shadowkv, enable_shadowkv
from neutrain.eval.kv.decode_graph import capture_decode_step


def llama3_8b_config():
    return transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    )


SDPA_BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")
"""The SDPA backends the full cache is timed under, each forced in turn beside the dispatcher's own choice:
its 64K figure moved from 132 to 78 to 64 tokens/s between H100 runs of the same code and batch, and the
backend the dispatcher picks is the first suspect. The baseline is the fastest of them."""


def smoke_config(size: str):
    """The stand-in model of a CPU smoke run and the card it pretends to have (numbers mean nothing there).
    ``small``: 4 x 256, ~20 MiB of KV headroom beside the 0.5 GiB margin; ``tiny``: 4 x 128 for a test."""
    hidden = 128 if size == "tiny" else 256
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    return cfg, int(0.52 * GIB)


CUDA_ONLY_ROWS = ("full_graph", "shadowkv_fused_graph")
"""The rows that replay a captured CUDA graph: on a CPU smoke run they record why they did not run
(``needs_cuda``), not a measurement."""
GRAPH_NEEDS_CUDA = "a CUDA graph of the decode step: the row runs on a GPU only"

SIZING_TOKENS = 4096
"""Tokens of the one-sequence build a row's stored bytes are measured on, then scaled to the context: what
a compressed cache stores grows with its tokens, and a 64K build of one sequence takes seconds of Python
(a store call per layer and chunk) that the plan has no room for."""

ROWS = ("full", "full_graph", "shadowkv", "shadowkv_fused_decode", "shadowkv_fused_decode_store_reads",
        "shadowkv_fused_graph", "kvpress_pruned",
        "minicache_merge_4bit", "minicache_4bit_only", "minicache_merge", "full_repeat", "quantized_cache_4bit",
        "minicache_merge_4bit_restore")
"""Every throughput row, in the order they run (every context of one before the next): the baseline and the cheap
rows first, the MiniCache rows, the full cache again, then the slow rows (QuantizedCache and the restore path,
1-2 s a step), which a run behind its plan cuts to fewer timed steps (``_kv_plan``), never to none."""


def throughput_part(args, log, device, host: PinnedBuffer | None = None, plan: TimePlan | None = None):
    """Decode tokens/s of every row at every context of ``args.contexts``; ``host`` is the pinned buffer (else
    pinned here), ``plan`` the run's time plan (each row's cap; none: ``--steps`` steps each)."""
    from neutrain.eval.kv import disable_minicache_attention, enable_minicache_attention
    from neutrain.kernels import minicache_attention as mc_kernels
    from neutrain.kernels import shadowkv as skv_kernels
    from neutrain.kernels import shadowkv_fused_decode as skv_fused_kernels

    if args.smoke:  # stand-in on CPU: exercises the code, numbers mean nothing
        cfg, total = smoke_config(args.smoke)
    else:
        cfg = llama3_8b_config()
        total = torch.cuda.get_device_properties(0).total_memory
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    d = cfg.hidden_size // cfg.num_attention_heads
    layers, heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    kv_per_token = 2 * layers * heads * d * 2
    v_host_per_token = kv_per_token // 2
    cuda = device.type == "cuda"
    if host is None:
        host = PinnedBuffer(int(host_buffer_gib(args) * GIB), cuda, log)
    t0 = time.perf_counter()
    host_values = host.get()
    host_bytes = host_values.numel() * host_values.element_size()
    budget = Budget(card=total, weights=weights, margin=int(args.margin_gib * GIB))
    results = {"weights_gib": weights / GIB, "card_gib": total / GIB, "host_pinned_gib": host_bytes / GIB,
               "pin_seconds": host.seconds, "pin_wait_seconds": round(time.perf_counter() - t0, 1),
               "margin_gib": args.margin_gib, "contexts": {},
               # Importing kvpress wraps every registered attention function, the full cache's included: a
               # throughput run after that import times the wrapper too (kv_eval.json at bc2f79f did).
               "kvpress_imported": "kvpress" in sys.modules,
               "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default"),
               "timing": f"median of 1-{args.steps} timed steps after the warm-up, each synchronized: at most "
                         f"--steps, fewer (at least 1, {MIN_STEPS} when they are cheap) when the row's cap comes "
                         "first (steps_cut)"}
    rank, outliers = (160, 48) if not args.smoke else (16, 2)
    chunk = MINICACHE_CHUNK if not args.smoke else 128
    warm = 1 if args.smoke == "tiny" else 2  # the tiny smoke's fused kernel runs in the interpreter: a few calls
    row_end = [None]  # the running row's deadline (the plan's cap from its start)

    def share(parts: int) -> float | None:
        """A deadline for the next of ``parts`` timings left in the running row: an equal share of what is left."""
        if row_end[0] is None:
            return None
        return time.time() + max(0.0, row_end[0] - time.time()) / parts

    def full(ctx, backends=SDPA_BACKENDS):
        # Largest batch whose K+V (+ the decode's working memory) fits beside the weights; no build transient.
        per_seq = kv_per_token * (ctx + 16) + decode_bytes_per_seq(cfg, ctx)
        b = budget.batch(per_seq)
        cache = full_cache(cfg, b, ctx, 16, device)
        backends = backends if cuda else ("FLASH_ATTENTION",)
        out = {"batch": b, **timed(model, cache, b, args.steps, warm, share(1 + len(backends))),
               "gpu_kv_gib": kv_per_token * (ctx + 16) * b / GIB, "host_gib": 0.0, **kernel_record(model, cache, b)}
        # The same cache under each SDPA backend forced, from the same length: the baseline is the fastest.
        from torch.nn.attention import SDPBackend, sdpa_kernel

        timings = {"default_dispatch": {k: out[k] for k in ("tokens_per_s", "ms_per_step", "attention_kernel")}}
        for i, name in enumerate(backends):
            rewind(cache, ctx)
            try:
                with sdpa_kernel(getattr(SDPBackend, name)):
                    row = timed(model, cache, b, args.steps, warm, share(len(backends) - i))
                    rewind(cache, ctx)
                    row.update(kernel_record(model, cache, b))
                timings[name.lower()] = {k: row[k] for k in ("tokens_per_s", "ms_per_step", "attention_kernel")}
            except RuntimeError as exc:  # this backend does not take these shapes (or is not built here)
                timings[name.lower()] = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
        best = max((k for k in timings if "tokens_per_s" in timings[k]), key=lambda k: timings[k]["tokens_per_s"])
        out.update(sdpa_backends=timings, baseline_backend=best, default_dispatch_tokens_per_s=out["tokens_per_s"],
                   tokens_per_s=timings[best]["tokens_per_s"], ms_per_step=timings[best]["ms_per_step"])
        return out

    def full_graph(ctx):
        # The full cache's step captured at each length, under the full row's fastest SDPA backend (the graph keeps
        # the backend of its capture; flash, then the dispatcher's choice, should that one not capture), at the
        # full row's batch: the eager step's kernels and bytes without the launches (benchmarks/kv/_kv_graph.py says
        # why not one graph under a mask).
        if not cuda:
            return {"needs_cuda": GRAPH_NEEDS_CUDA}
        from contextlib import nullcontext

        from torch.nn.attention import SDPBackend, sdpa_kernel

        best = results["contexts"][str(ctx)].get("full", {}).get("baseline_backend") or "default_dispatch"
        b = budget.batch(kv_per_token * (ctx + 16) + decode_bytes_per_seq(cfg, ctx))
        cache = full_cache(cfg, b, ctx, 16, device)
        errors = {}
        for name in dict.fromkeys((best, "flash_attention", "default_dispatch")):
            forced = nullcontext() if name == "default_dispatch" else sdpa_kernel(getattr(SDPBackend, name.upper()))
            rewind(cache, ctx)
            graphs = PerLengthGraph(model, cache, b)
            try:
                with forced:
                    out = timed(model, cache, b, args.steps, warm, share(1), step=graphs.step, prepare=graphs.prepare)
                    graphs.prepare()
            except RuntimeError as exc:  # this backend's step did not capture (or does not take these shapes)
                errors[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
                continue
            out.update(graph_kernel_record(model, cache, b, graphs.step))
            out.update(replay_timeline(graphs.step, cuda))  # the graph hides the phases: its kernels show them
            return {"batch": b, **out, "sdpa_backend": name, "backend_errors": errors, "captures": graphs.captures,
                    "gpu_kv_gib": kv_per_token * (ctx + 16) * b / GIB, "host_gib": 0.0,
                    "capture": "one graph per length, captured before each timed replay (untimed)"}
        return {"batch": b, "error": "no SDPA backend's step could be captured", "backend_errors": errors}

    def full_repeat(ctx):
        # The baseline again after the compressed rows, under the backend that won the first time (no sweep).
        first = results["contexts"][str(ctx)].get("full", {}).get("baseline_backend")
        return full(ctx, (first.upper(),) if first and first != "default_dispatch" else ())

    def shadowkv(ctx, fused=False, store_reads=False, graph=False):
        # Two batches: rows whose values fit in the pinned host buffer offload them and the rest keep them on the
        # GPU as long as it has room (the most rows), or every row's values on the GPU (fewer rows, no PCIe).
        # The host rows' values cross PCIe at every step (~0.65 ms a layer for 16 rows at 64K on an H200), so
        # the most rows is not the fastest: the graphed row times both and reports the faster, the other beside
        # it (``alternatives``). ``graph``: the step captured and replayed (neutrain/eval/kv/decode_graph.py).
        if graph and not cuda:
            return {"needs_cuda": GRAPH_NEEDS_CUDA}
        chunks = ctx // 8
        per_seq = int(1.1 * layers * 2 * (ctx * rank + chunks * heads * (d + 4)
                                          + (outliers * 8 + 64 + 2 * 1024) * 2 * heads * d))
        v_per_seq = v_host_per_token * ctx
        headroom = budget.headroom
        b_host = host_bytes // v_per_seq
        if b_host * per_seq >= headroom:
            b, rows = max(1, headroom // per_seq), 0
        else:
            rows = int((headroom - b_host * per_seq) // (per_seq + v_per_seq))
            b = b_host + rows
        device_only = max(1, int(headroom // (per_seq + v_per_seq)))
        sizes = [(b, rows)]
        if graph and (device_only, device_only) != (b, rows):
            sizes.append((device_only, device_only))
        if args.smoke:  # the fused row's kernel runs in Triton's interpreter there: both rows at a batch it takes
            cap = {"small": 2, "tiny": 1}[args.smoke]
            sizes = list(dict.fromkeys((min(n, cap), min(r, n, cap)) for n, r in sizes))
        measured = []
        for n, r in sizes:
            if measured:
                release_memory(model, cuda)
            measured.append(shadowkv_at(ctx, n, r, fused, store_reads, graph))
        best = max(measured, key=lambda row: row.get("tokens_per_s") or 0.0)
        if len(measured) > 1:
            best["alternatives"] = [{key: row.get(key) for key in ("batch", "device_value_rows", "host_value_rows",
                                                                   "tokens_per_s", "ms_per_step")}
                                    for row in measured if row is not best]
        return best

    def shadowkv_at(ctx, b, rows, fused, store_reads, graph):
        enable_shadowkv(model, budget=0.0156, rank=rank, chunk_size=8, outliers=outliers, fused_decode=fused,
                        fused_store_reads=store_reads)
        try:
            before = skv_kernels.COUNTERS["gather_chunks"]
            fused_before = skv_fused_kernels.COUNTERS["shadowkv_fused_decode"]
            cache = shadowkv_cache(model, cfg, b, ctx, host_values, device, device_rows=rows)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            step = captured = None
            if graph:  # the tail's free slots (tail_capacity, 256) cover the replays below
                captured = capture_decode_step(model, cache, b, warmup=warm)
                step = captured.step
            out = timed(model, cache, b, args.steps, warm, share(1), step=step)
            stats = cache.stats()  # the warm-up and timed steps' counts, graphed or not
            out.update(graph_kernel_record(model, cache, b, step) if graph else kernel_record(model, cache, b))
            if graph:  # the replays' kernels first: the eager step below moves the cache past the capture
                out.update(replay_timeline(step, cuda, SHADOWKV_KERNEL_GROUPS))
                split = graph_against_eager(captured, eager_step(model, cache, b))
                out.update(captures=captured.captures, replays=captured.replays)
            else:
                split = shadowkv_step_split(model, cache, b) if cuda else {"skipped": "needs CUDA events"}
            out["fused_kernel_launches"] = skv_fused_kernels.COUNTERS["shadowkv_fused_decode"] - fused_before
            if out["fused_kernel_launches"] and "triton:shadowkv_fused" not in (out["attention_kernel"] or ""):
                # Triton's CPU interpreter runs the kernel as Python: no profiler op names it (the smoke run)
                named = [out["attention_kernel"], "triton:shadowkv_fused_decode"]
                out["attention_kernel"] = "+".join(filter(None, named))
            log(f"ctx {ctx} shadowkv (fused {fused}, store reads {store_reads}, graph {graph}) step split (ms): "
                f"{split}")
        finally:
            disable_shadowkv(model)
        return {"batch": b, "device_value_rows": rows, "host_value_rows": b - rows, **out,
                "gpu_kv_gib": stats["device_bytes"] / GIB,
                "host_gib": stats["host_bytes"] / GIB, "uva_kernel_launches": skv_kernels.COUNTERS["gather_chunks"] - before,
                "sparse_steps": stats["sparse_steps"], "fused_steps": stats["fused_steps"],
                "uva_gathers": stats["uva_gathers"], "step_split": split,
                "peak_gpu_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None}

    def sized_run(ctx, build, stored_of, transient_per_seq, timeline_groups=None):
        """Measure what one sequence stores (``build(1, tokens)`` on ``SIZING_TOKENS``, scaled to ``ctx``), size the
        batch by that plus the build's and the decode's transient memory (``_kv_sizing``), build and time it;
        after an out-of-memory error the batch halves, down to 1, the failed attempt's memory freed first."""
        probe = min(ctx, SIZING_TOKENS)
        stored = int(stored_of(build(1, probe)) * ctx / probe)
        per_seq = stored + transient_per_seq
        b = budget.batch(per_seq, cap={"small": 2, "tiny": 1}.get(args.smoke))  # the smoke's kernel is interpreted
        sizing = {"stored_gib_per_seq": stored / GIB, "stored_measured_on_tokens": probe,
                  "transient_gib_per_seq": transient_per_seq / GIB, "sized_batch": b}
        release_memory(model, cuda)

        def attempt(batch):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            cache = build(batch, ctx)
            if cuda:  # the prefill's freed blocks back to the driver: the decode's first allocations map fresh pages
                torch.cuda.empty_cache()
            stats = cache.stats()
            out = timed(model, cache, batch, args.steps, warm, share(1))
            if hasattr(cache, "fused_steps"):
                out["fused_steps"] = cache.fused_steps
            out.update(kernel_record(model, cache, batch))  # after timing, as the full cache's
            if timeline_groups is not None:  # the eager step's kernels, busy and idle: where its time goes
                out.update(replay_timeline(eager_step(model, cache, batch), cuda, timeline_groups, replays=2))
            peak = torch.cuda.max_memory_allocated() / GIB if cuda else None
            # reserved above allocated: what the allocator's fragmentation cost
            reserved = torch.cuda.max_memory_reserved() / GIB if cuda else None
            return {"batch": batch, **out, **stats, "peak_gpu_gib": peak, "peak_reserved_gib": reserved,
                    "predicted_peak_gib": budget.predicted_peak(batch, per_seq) / GIB}

        out, attempts = run_with_backoff(b, attempt, lambda: release_memory(model, cuda), log, f"ctx {ctx}")
        return {**out, **sizing, "oom_retries": len(attempts) - 1, "attempts": attempts}

    def minicache(ctx, quant_bits, fused=True, start_layer=None):
        # The memory merging and 4-bit save is turned into batch: one sequence is built to measure it (with the
        # fused decode's factors and retained rows). The restore path also copies one layer per step.
        opts = dict(gamma=0.05, quant_bits=quant_bits, quant_group=64, fused_decode=fused, start_layer=start_layer)
        merged = start_layer is None or start_layer < layers - 1
        transient = minicache_transient_bytes_per_seq(cfg, ctx, chunk, quant_bits, merged, fused)
        before = dict(mc_kernels.COUNTERS)
        if fused:
            enable_minicache_attention(model)
        try:
            out = sized_run(ctx, lambda b, n: minicache_cache(model, cfg, b, n, device, chunk=chunk, **opts),
                            lambda c: (prepare_fused(c) if fused else c).stored_bytes(), transient,
                            MINICACHE_KERNEL_GROUPS if fused else None)
        finally:
            disable_minicache_attention(model)
        out["gpu_kv_gib"] = out.pop("stored_bytes") / GIB
        out["kernel_calls"] = mc_kernels.COUNTERS["calls"] - before["calls"]
        if out["kernel_calls"] and "triton:minicache" not in (out["attention_kernel"] or ""):
            # Triton's CPU interpreter runs the kernel as Python: no profiler op names it (the smoke run)
            out["attention_kernel"] = "+".join(filter(None, ["triton:minicache", out["attention_kernel"]]))
        return {**out, "merge": f"prefill only (chunks of {chunk:,} tokens)" if merged else "none (4-bit only)",
                "decode": "fused kernel over the stores" if fused else "restore to bf16, then SDPA"}

    def quantized(ctx):
        out = sized_run(ctx, lambda b, n: quantized_cache(model, cfg, b, n, device),
                        lambda c: c.stats()["device_bytes"], decode_bytes_per_seq(cfg, ctx, "quantized"))
        out["gpu_kv_gib"] = out.pop("device_bytes") / GIB
        return {**out, "backend": "quanto (torch unpack), 4-bit, group 64, residual 128"}

    def pruned(ctx):
        kept = int(round(ctx * (1 - PRESS_RATIO)))
        # DynamicCache re-copies a layer per step (torch.cat): one layer's K+V of headroom for that.
        b = max(1, int(budget.headroom * layers / (layers + 1)) // (kv_per_token * (kept + 16)))
        cache = pruned_cache(cfg, b, kept, ctx, device)
        return {"batch": b, **timed(model, cache, b, args.steps, warm, share(1)), "kept_tokens": kept,
                **kernel_record(model, cache, b), "gpu_kv_gib": kv_per_token * kept * b / GIB,
                "compression_ratio": ctx / kept,
                "what": f"decode after any kvpress press at compression_ratio {PRESS_RATIO} (PrunedCache)"}

    chosen = getattr(args, "rows", None)
    labels = [label for label in ROWS if chosen is None or label == "full" or label in chosen]
    order = [(label, ctx) for label in labels for ctx in args.contexts]  # the order the rows run in

    def guarded(ctx, label, fn, *a):
        # No row is skipped for time: its cap (the plan's seconds, or its share of what is left when the run is
        # behind) bounds its timed steps only (steps_within).
        planned = plan.rows.get((label, ctx)) if plan else None
        cap = plan.cap((label, ctx), order[order.index((label, ctx)) + 1:], DEADLINE.left()) if plan else None
        start = time.time()
        row_end[0] = start + cap if cap is not None else None
        try:
            out = fn(ctx, *a)
        except Exception as exc:  # noqa: BLE001 - record and go on: one OOM must not lose the other numbers
            out = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        out["seconds"] = round(time.time() - start, 1)
        if planned is not None:
            out["planned_seconds"] = planned
            if cap < planned:
                out["cap_seconds"] = round(cap, 1)
                out["cap_note"] = ("the run was behind its plan when the row started: its share of the seconds left "
                                   "before the accuracy parts'")
        release_memory(model, cuda)
        log(f"ctx {ctx} {label}: {out}")
        return out

    # MiniCache: the fused decode for each setting, "4-bit only" (what merging only similar pairs leaves when
    # no pair qualifies, as on SmolLM2 and the retrieval model) and the restore path once, for the comparison.
    # The full cache again at the end: a baseline that moved within the call shows there.
    runs = {"full": (full, ()), "full_graph": (full_graph, ()), "shadowkv": (shadowkv, ()),
            "shadowkv_fused_decode": (shadowkv, (True,)), "shadowkv_fused_decode_store_reads": (shadowkv, (True, True)),
            "shadowkv_fused_graph": (shadowkv, (True, True, True)),
            "minicache_merge_4bit": (minicache, (4,)),
            "kvpress_pruned": (pruned, ()), "minicache_4bit_only": (minicache, (4, True, layers)),
            "minicache_merge": (minicache, (None,)), "full_repeat": (full_repeat, ()),
            "minicache_merge_4bit_restore": (minicache, (4, False)), "quantized_cache_4bit": (quantized, ())}
    for ctx in args.contexts:  # the most important measurements of every context first
        results["contexts"][str(ctx)] = {}
    for label in labels:
        fn, extra = runs[label]
        for ctx in args.contexts:
            row = results["contexts"][str(ctx)]
            row[label] = guarded(ctx, label, fn, *extra)
            full_row = row["full"]
            if label != "full" and "tokens_per_s" in row[label] and "tokens_per_s" in full_row:
                row[label]["speedup_vs_full"] = row[label]["tokens_per_s"] / full_row["tokens_per_s"]
                row[label]["speedup_vs_full_default_dispatch"] = (row[label]["tokens_per_s"]
                                                                  / full_row["default_dispatch_tokens_per_s"])
            graphed = row.get("full_graph", {})
            if label not in ("full", "full_graph") and "tokens_per_s" in row[label] and "tokens_per_s" in graphed:
                # against the faster full cache: the graphed one removes the host's launch time too
                row[label]["speedup_vs_full_graph"] = row[label]["tokens_per_s"] / graphed["tokens_per_s"]
    return results

