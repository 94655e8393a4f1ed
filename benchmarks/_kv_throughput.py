"""The KV-cache benchmark's throughput part: decode tokens/s at long contexts on Llama-3-8B shapes.

Llama-3-8B architecture, random bf16 weights, contexts 32K and 64K. Decode tokens/s at the largest
batch that fits for the full cache (preallocated, in-place writes: the fair baseline; transformers'
DynamicCache would re-copy the whole cache each step), ShadowKV (values in pinned host memory, the
batch sized by GPU memory: overflow rows keep their values on the GPU; its step split by phase with
CUDA events), MiniCache (merge, merge + 4-bit, 4-bit only, decoding through the fused kernel of
neutrain/kernels/minicache_attention.py; merge + 4-bit once through the old restore path), a
kvpress-pruned cache and QuantizedCache. The caches are filled with random states of the target
length instead of running a 64K prefill per sequence: decode cost does not depend on the values,
and the prefill of 8B x 64K x batch would not fit the run's time limit.
"""

from __future__ import annotations

import gc
import math
import sys
import time

import torch
import transformers
from transformers.cache_utils import Cache, DynamicLayer

from benchmarks._kv_common import DEADLINE, PRESS_RATIO
from neutrain import compat
from neutrain.eval.kv import MiniCache, ShadowKVCache, disable_shadowkv, enable_shadowkv

def llama3_8b_config():
    return transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    )


class PreallocatedLayer(DynamicLayer):
    """Full-cache baseline: one buffer per layer, new tokens written in place (no per-step re-copy)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self.buf_k, self.buf_v, self.length = keys, values, length
        self.keys, self.values, self.is_initialized, self.device = keys[:, :, :0], values[:, :, :0], True, keys.device

    def update(self, key_states, value_states, *args, **kwargs):
        n = key_states.shape[-2]
        self.buf_k[:, :, self.length : self.length + n] = key_states
        self.buf_v[:, :, self.length : self.length + n] = value_states
        self.length += n
        return self.buf_k[:, :, : self.length], self.buf_v[:, :, : self.length]

    def get_seq_length(self) -> int:
        return self.length


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _decode_rate(model, cache, batch, steps, warmup=2):
    kwarg = compat.cache_forward_kwarg(model)
    ids = torch.randint(0, 100, (batch, 1), device=next(model.parameters()).device)
    with torch.inference_mode():
        for _ in range(warmup):
            model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kwarg: cache})
        _sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kwarg: cache})
        _sync()
    dt = time.perf_counter() - t0
    return batch * steps / dt, dt / steps * 1e3


def attention_ops(model, cache, batch) -> dict[str, int]:
    """The attention ops and kernels one more decode step runs, by name, with their counts.

    Why: the full cache's decode step at 64K took 53 ms in one H100 run and 90 ms in another with the same
    code (benchmarks/notes_kv_eval.md); the SDPA dispatcher's choice of backend (flash, efficient, cuDNN,
    math) is the first suspect, so each throughput figure records which one ran.
    """
    import re

    from torch.profiler import ProfilerActivity, profile

    kwarg = compat.cache_forward_kwarg(model)
    ids = torch.randint(0, 100, (batch, 1), device=next(model.parameters()).device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ids.is_cuda else [])
    with profile(activities=activities) as prof, torch.inference_mode():
        model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kwarg: cache})
        _sync()
    # SDPA's backends, and neutrain's own decode kernels (MiniCache's segment/combine, ShadowKV's gather)
    pattern = re.compile(r"scaled_dot_product|attention|fmha|flash|cudnn|_segment_kernel|_combine_kernel|gather_chunks",
                         re.IGNORECASE)
    return {e.key[:160]: e.count for e in prof.key_averages() if pattern.search(e.key)}


SHADOWKV_PHASES = ("selection", "gather_launch", "reconstruction", "gather_wait", "attention")


def shadowkv_step_split(model, cache, batch) -> dict:
    """One more decode step of a ShadowKV ``cache``, its time split by phase with CUDA events, summed over layers.

    Phases, in stream order inside each layer's sparse attention (``ShadowKVCache.mark``): ``selection``
    (landmark scores, top-k, chunk ids), ``gather_launch`` (the device rows' value gather and the launch of the
    host rows' gather on its side stream), ``reconstruction`` (low-rank key rebuild and RoPE), ``gather_wait``
    (the host gather not hidden behind the rebuild, and the join of the row blocks), ``attention`` (the
    concatenations and SDPA); ``rest`` is the step outside the sparse attention (projections, MLP, norms,
    sampling). ``host_gather_kernel_ms`` is the side stream's gather kernel itself (overlapping the phases).
    """
    kwarg = compat.cache_forward_kwarg(model)
    ids = torch.randint(0, 100, (batch, 1), device=next(model.parameters()).device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cache.phase_events = []
    try:
        with torch.inference_mode():
            begin.record()
            model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kwarg: cache})
            end.record()
        torch.cuda.synchronize()
        events = cache.phase_events
    finally:
        cache.phase_events = None
    main = [(name, ev) for name, ev in events if not name.startswith("host_gather")]
    phases = dict.fromkeys(SHADOWKV_PHASES, 0.0)
    for (_, e0), (name, e1) in zip(main, main[1:]):
        if name != "start":  # from one layer's end to the next one's start is "rest"
            phases[name] += e0.elapsed_time(e1)
    host = [ev for name, ev in events if name.startswith("host_gather")]
    step = begin.elapsed_time(end)
    out = {"step_ms": round(step, 3), **{f"{k}_ms": round(v, 3) for k, v in phases.items()},
           "rest_ms": round(step - sum(phases.values()), 3),
           "host_gather_kernel_ms": round(sum(a.elapsed_time(b) for a, b in zip(host[0::2], host[1::2])), 3),
           "layers": sum(1 for name, _ in main if name == "start")}
    return out


def _full_cache(cfg, batch, ctx, extra, device):
    d = cfg.hidden_size // cfg.num_attention_heads
    layers = []
    for _ in range(cfg.num_hidden_layers):
        k = torch.empty(batch, cfg.num_key_value_heads, ctx + extra, d, dtype=torch.bfloat16, device=device).normal_()
        v = torch.empty_like(k).normal_()
        layers.append(PreallocatedLayer(k, v, ctx))
    return Cache(layers=layers)


def _shadowkv_cache(model, cfg, batch, ctx, host_values, device, device_rows: int = 0):
    """A ShadowKV cache in its post-prefill state for ``batch`` x ``ctx`` (random contents, real shapes).

    The values of the first ``batch - device_rows`` rows live in ``host_values`` (pinned), the last
    ``device_rows`` rows' on the GPU (``ShadowKVOptions.device_value_rows``).
    """
    cache = ShadowKVCache.for_model(model)
    o = cache.options
    h, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    cs, outliers, local = cache.layers[0].geometry(ctx)  # as compress() would lay out a ctx-token prompt
    chunks = (ctx - local) // cs
    kept = chunks - outliers
    dev = torch.device(device)
    on_host = batch - device_rows
    per_layer = on_host * h * chunks * cs * d
    for i, layer in enumerate(cache.layers):
        bf = dict(dtype=torch.bfloat16, device=dev)
        layer.lazy_initialization(torch.empty(1, **bf), torch.empty(1, **bf))
        layer.u = torch.randn(batch, ctx, o.rank, **bf) / math.sqrt(ctx)
        layer.sv = torch.randn(batch, h, o.rank, d, **bf)
        layer.landmarks = torch.randn(batch, h, kept, d, **bf)
        layer.landmark_chunk = torch.arange(outliers, chunks, device=dev).expand(batch, h, kept).contiguous()
        layer.outlier_k = torch.randn(batch, h, outliers * cs, d, **bf)
        layer.outlier_v = torch.randn(batch, h, outliers * cs, d, **bf)
        layer.tail_k = torch.randn(batch, h, ctx - chunks * cs, d, **bf)
        layer.tail_v = torch.randn(batch, h, ctx - chunks * cs, d, **bf)
        layer.v_store = host_values[i * per_layer : (i + 1) * per_layer].view(on_host, h, chunks, cs * d)
        layer.v_device = torch.randn(device_rows, h, chunks * cs, d, **bf) if device_rows else None
        layer.exact_k, layer.selection_log = None, []
        layer.offloaded, layer.pos0 = True, torch.zeros(1, 1, dtype=torch.long, device=dev)
        layer.num_chunks, layer.context = chunks, chunks * cs
        layer.select = max(1, min(cache.budget_tokens(ctx) // cs, kept))
        layer.seen, layer.mode, layer.chunk_size = ctx, "sparse", cs
    return cache


def _minicache(model, cfg, batch, ctx, device, chunk: int = 4096, **options):
    """A MiniCache after a ``ctx``-token prefill of random states, merged for real.

    The prompt is fed in blocks of ``chunk`` tokens, every layer per block (a chunked prefill), each
    pair merging each block: merging 64K tokens of a large batch at once needs several fp32 copies of
    the pair's states. After the prefill, ``merge_every`` is None: decoding merges nothing.
    """
    cache = MiniCache(cfg, merge_every=chunk, **options)
    d = cfg.hidden_size // cfg.num_attention_heads
    with torch.inference_mode():
        for start in range(0, ctx, chunk):
            shape = (batch, cfg.num_key_value_heads, min(chunk, ctx - start), d)
            for i in range(cfg.num_hidden_layers):
                k = torch.randn(shape, dtype=torch.bfloat16, device=device)
                cache.store(k, torch.randn_like(k), i)  # no restored copy of the layer per block
                del k
        for layer in cache.layers:  # a last block shorter than ``chunk`` is merged too
            if layer.role == "second" and layer.pair.keys.residual_length():
                cache._merge(layer.pair)
    cache.merge_every = None
    return cache


def _quantized_cache(model, cfg, batch, ctx, device):
    """transformers' QuantizedCache (4-bit) after a ``ctx``-token prefill of random states."""
    from neutrain.eval.kv.baselines import quantized_cache_factory

    d = cfg.hidden_size // cfg.num_attention_heads
    with quantized_cache_factory(model, nbits=4, group=64, residual=128) as make, torch.inference_mode():
        cache = make()
        for i in range(cfg.num_hidden_layers):
            k = torch.randn(batch, cfg.num_key_value_heads, ctx, d, dtype=torch.bfloat16, device=device)
            cache.update(k, torch.randn_like(k), i)
            del k
    return cache


def _pruned_cache(cfg, batch, kept, ctx, device):
    """What a kvpress press leaves after prefill: a DynamicCache of ``kept`` tokens, logical length ``ctx``.

    Every press leaves the same shapes (they differ in which tokens they keep), so one decode rate
    stands for all of them at a given compression ratio.
    """
    from neutrain.eval.kv.baselines import PrunedCache

    d = cfg.hidden_size // cfg.num_attention_heads
    cache = PrunedCache(config=cfg)
    for layer in cache.layers:
        k = torch.randn(batch, cfg.num_key_value_heads, kept, d, dtype=torch.bfloat16, device=device)
        layer.lazy_initialization(k, k)
        layer.keys, layer.values, layer.seen = k, torch.randn_like(k), ctx
    return cache


def _host_gib(requested: float) -> float:
    """``requested`` GiB of pinned host memory, capped at 80% of what the host has available."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) / 2**20
    except (OSError, StopIteration):
        return requested
    return max(0.05, min(requested, 0.8 * avail))


def throughput_part(args, log, device):
    from neutrain.eval.kv import disable_minicache_attention, enable_minicache_attention
    from neutrain.kernels import minicache_attention as mc_kernels
    from neutrain.kernels import shadowkv as skv_kernels

    if args.smoke:  # tiny stand-in on CPU: exercises the code, numbers mean nothing
        cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=128)
        total = int(0.52 * 2**30)  # ~20 MiB of KV headroom beside the 0.5 GiB margin: small batches for the interpreter
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
    host_gib = args.host_gib if args.smoke else _host_gib(args.host_gib)
    host_bytes = int(host_gib * 2**30)
    t0 = time.perf_counter()
    # Page-locking faults every page in (zero-filled by the OS): no fill needed, and decode cost ignores values.
    host_values = torch.empty(host_bytes // 2, dtype=torch.bfloat16, pin_memory=device.type == "cuda")
    log(f"pinned {host_gib:.1f} GiB host buffer in {time.perf_counter() - t0:.1f}s")
    results = {"weights_gib": weights / 2**30, "card_gib": total / 2**30, "host_pinned_gib": host_gib,
               "pin_seconds": round(time.perf_counter() - t0, 1), "contexts": {},
               # Importing kvpress wraps every registered attention function, the full cache's included: a
               # throughput run after that import times the wrapper too (kv_eval.json at bc2f79f did).
               "kvpress_imported": "kvpress" in sys.modules}
    headroom = total - weights - int(args.margin_gib * 2**30)
    rank, outliers = (160, 48) if not args.smoke else (16, 2)

    def full(ctx):
        # Largest batch whose K+V (+ decode steps) fits beside the weights.
        b = max(1, headroom // (kv_per_token * (ctx + 16)))
        cache = _full_cache(cfg, b, ctx, 16, device)
        tps, ms = _decode_rate(model, cache, b, args.steps)
        return {"batch": b, "tokens_per_s": tps, "ms_per_step": ms,
                "gpu_kv_gib": kv_per_token * (ctx + 16) * b / 2**30, "host_gib": 0.0,
                "attention_ops": attention_ops(model, cache, b)}  # after timing: the profiler costs nothing above

    def shadowkv(ctx):
        # The batch is sized by GPU memory: rows whose values fit in the pinned host buffer offload them,
        # the rest keep them on the GPU (device_value_rows) as long as the GPU has room.
        chunks = ctx // 8
        per_seq = int(1.1 * layers * 2 * (ctx * rank + chunks * heads * (d + 4)
                                          + (outliers * 8 + 64 + 2 * 1024) * 2 * heads * d))
        v_per_seq = v_host_per_token * ctx
        b_host = host_bytes // v_per_seq
        if b_host * per_seq >= headroom:
            b, rows = max(1, headroom // per_seq), 0
        else:
            rows = int((headroom - b_host * per_seq) // (per_seq + v_per_seq))
            b = b_host + rows
        enable_shadowkv(model, budget=0.0156, rank=rank, chunk_size=8, outliers=outliers)
        try:
            before = skv_kernels.COUNTERS["gather_chunks"]
            cache = _shadowkv_cache(model, cfg, b, ctx, host_values, device, device_rows=rows)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            tps, ms = _decode_rate(model, cache, b, args.steps)
            stats = cache.stats()
            split = shadowkv_step_split(model, cache, b) if device.type == "cuda" else {"skipped": "needs CUDA events"}
            ops = attention_ops(model, cache, b)
            log(f"ctx {ctx} shadowkv step split (ms): {split}")
        finally:
            disable_shadowkv(model)
        return {"batch": b, "device_value_rows": rows, "host_value_rows": b - rows, "tokens_per_s": tps,
                "ms_per_step": ms, "gpu_kv_gib": stats["device_bytes"] / 2**30,
                "host_gib": stats["host_bytes"] / 2**30, "uva_kernel_launches": skv_kernels.COUNTERS["gather_chunks"] - before,
                "sparse_steps": stats["sparse_steps"], "uva_gathers": stats["uva_gathers"], "step_split": split,
                "attention_ops": ops,
                "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}

    # Per decode step a compressed store is read back to bf16, one layer at a time: unpacked codes,
    # their bf16 copy, the dequantized and the concatenated tensor, for keys and values, and for a merged
    # pair the shared direction kept for its second layer. Measured on an H200 at 64K (kv_eval_gpu_smoke_h200):
    # MiniCache merge + 4-bit ran out of memory at 31 sequences with 16 bytes an element budgeted (so 40
    # for it); QuantizedCache fitted at 16.
    restore_per_seq = lambda ctx, per_element: per_element * heads * ctx * d  # noqa: E731

    def sized_run(ctx, build, stored_of, per_element):
        """Build one sequence to measure its stored bytes, size the batch by them, build and time it;
        on an out-of-memory error retry at 3/4 of the batch (twice at most)."""
        per_seq = stored_of(build(1))
        b = max(1, int(headroom // (per_seq + restore_per_seq(ctx, per_element))))
        if args.smoke:  # the fused kernel runs in Triton's CPU interpreter there: a few sequences, not dozens
            b = min(b, 2)
        for attempt in range(3):
            cache = None
            try:
                cache = build(b)
                stats = cache.stats()
                tps, ms = _decode_rate(model, cache, b, args.steps)
                extra = {"fused_steps": cache.fused_steps} if hasattr(cache, "fused_steps") else {}
                extra["attention_ops"] = attention_ops(model, cache, b)  # after timing, as the full cache's
                return {"batch": b, "tokens_per_s": tps, "ms_per_step": ms, "stored_gib_per_seq": per_seq / 2**30,
                        "oom_retries": attempt, **stats, **extra}
            except torch.OutOfMemoryError:
                del cache
                gc.collect()
                torch.cuda.empty_cache()
                if attempt == 2 or b == 1:
                    raise
                b = max(1, b * 3 // 4)

    def minicache(ctx, quant_bits, fused=True, start_layer=None):
        # The memory merging and 4-bit save is turned into batch: one sequence is built to measure it. The fused
        # decode reads the stores in place, so no per-step restore copy is budgeted (the restore path: 40 bytes
        # an element, above).
        opts = dict(gamma=0.05, quant_bits=quant_bits, quant_group=64, fused_decode=fused, start_layer=start_layer)
        before = dict(mc_kernels.COUNTERS)
        if fused:
            enable_minicache_attention(model)
        try:
            out = sized_run(ctx, lambda b: _minicache(model, cfg, b, ctx, device, **opts), lambda c: c.stored_bytes(),
                            0 if fused else 40)
        finally:
            disable_minicache_attention(model)
        out["gpu_kv_gib"] = out.pop("stored_bytes") / 2**30
        out["kernel_calls"] = mc_kernels.COUNTERS["calls"] - before["calls"]
        return {**out, "merge": "prefill only (chunks of 4,096 tokens)" if start_layer is None else "none (4-bit only)",
                "decode": "fused kernel over the stores" if fused else "restore to bf16, then SDPA"}

    def quantized(ctx):
        out = sized_run(ctx, lambda b: _quantized_cache(model, cfg, b, ctx, device), lambda c: c.stats()["device_bytes"], 16)
        out["gpu_kv_gib"] = out.pop("device_bytes") / 2**30
        return {**out, "backend": "quanto (torch unpack), 4-bit, group 64, residual 128"}

    def pruned(ctx):
        kept = int(round(ctx * (1 - PRESS_RATIO)))
        # DynamicCache re-copies a layer per step (torch.cat): one layer's K+V of headroom for that.
        b = max(1, int(headroom * layers / (layers + 1)) // (kv_per_token * (kept + 16)))
        cache = _pruned_cache(cfg, b, kept, ctx, device)
        tps, ms = _decode_rate(model, cache, b, args.steps)
        return {"batch": b, "tokens_per_s": tps, "ms_per_step": ms, "kept_tokens": kept,
                "attention_ops": attention_ops(model, cache, b),
                "gpu_kv_gib": kv_per_token * kept * b / 2**30, "compression_ratio": ctx / kept,
                "what": f"decode after any kvpress press at compression_ratio {PRESS_RATIO} (PrunedCache)"}

    def guarded(label, fn, *a):
        if DEADLINE.left() < 35:  # the longest row (MiniCache at 64K, an out-of-memory retry) takes ~30 s
            out = {"skipped": "the run's time budget (--budget-seconds)"}
        else:
            start = time.time()
            try:
                out = fn(*a)
            except Exception as exc:  # noqa: BLE001 - record and go on: one OOM must not lose the other numbers
                out = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            out["seconds"] = round(time.time() - start, 1)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        log(f"{label}: {out}")
        return out

    # MiniCache: the fused decode for each setting, "4-bit only" (what merging only similar pairs leaves when
    # no pair qualifies, as on SmolLM2 and the retrieval model) and the restore path once, for the comparison.
    runs = [("full", full, ()), ("shadowkv", shadowkv, ()), ("minicache_merge_4bit", minicache, (4,)),
            ("kvpress_pruned", pruned, ()), ("minicache_4bit_only", minicache, (4, True, layers)),
            ("minicache_merge", minicache, (None,)), ("minicache_merge_4bit_restore", minicache, (4, False)),
            ("quantized_cache_4bit", quantized, ())]
    for ctx in args.contexts:  # the most important measurements of every context first
        results["contexts"][str(ctx)] = {}
    for label, fn, extra in runs:
        for ctx in args.contexts:
            row = results["contexts"][str(ctx)]
            row[label] = guarded(f"ctx {ctx} {label}", fn, ctx, *extra)
            if label != "full" and "tokens_per_s" in row[label] and "tokens_per_s" in row["full"]:
                row[label]["speedup_vs_full"] = row[label]["tokens_per_s"] / row["full"]["tokens_per_s"]
    return results

