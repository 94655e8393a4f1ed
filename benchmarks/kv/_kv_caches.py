"""The KV-cache benchmark's throughput caches: each row's cache built in its post-prefill state, on real shapes.

Every timed row decodes from a cache built here: the full cache preallocated with in-place writes (the fair
baseline: transformers' DynamicCache would re-copy the whole cache each step), ShadowKV with its values in
the pinned host buffer (``PinnedBuffer``), MiniCache merged for real by a chunked prefill, transformers'
QuantizedCache, and what a kvpress press leaves; ``release_memory`` frees what a failed build left. The
caches are filled with random states of the target length instead of running a 64K prefill per sequence:
decode cost does not depend on the values, and the prefill of 8B x 64K x batch would not fit the run's time
limit. The timing is ``_kv_timing``'s and the rows ``_kv_throughput``'s: a test builds one cache with
neither.
"""

from __future__ import annotations

import gc
import math
import threading
import time

import torch
from transformers.cache_utils import Cache, DynamicLayer

from benchmarks.kv._kv_sizing import GIB
from neutrain.eval.kv import MiniCache, ShadowKVCache
from neutrain.eval.kv.minicache_attention import pair_state
from neutrain.eval.kv.shadowkv_math import pad_landmarks


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


def rewind(cache, length: int) -> None:
    """Put a preallocated full cache back at ``length`` tokens: every timing of it starts from the same context."""
    for layer in cache.layers:
        layer.length = length


def full_cache(cfg, batch, ctx, extra, device):
    """The full cache (``PreallocatedLayer``) at ``ctx`` tokens of random states, ``extra`` free slots to decode."""
    d = cfg.hidden_size // cfg.num_attention_heads
    layers = []
    for _ in range(cfg.num_hidden_layers):
        k = torch.empty(batch, cfg.num_key_value_heads, ctx + extra, d, dtype=torch.bfloat16, device=device).normal_()
        v = torch.empty_like(k).normal_()
        layers.append(PreallocatedLayer(k, v, ctx))
    return Cache(layers=layers)


def shadowkv_cache(model, cfg, batch, ctx, host_values, device, device_rows: int = 0):
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
        layer.landmarks = pad_landmarks(torch.randn(batch, h, kept, d, **bf))  # as compress() stores them
        layer.num_landmarks = kept
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


MINICACHE_CHUNK = 1024
"""Tokens per block of the throughput part's MiniCache prefill: a merged pair's block goes through SLERP in
fp32 at ~48 bytes an element (``_kv_sizing.MERGE_BLOCK_BYTES``), 48 MiB a sequence at 1,024 tokens of
Llama-3-8B's keys against 190 MiB at 4,096, and that is memory the batch cannot use."""


def minicache_cache(model, cfg, batch, ctx, device, chunk: int = MINICACHE_CHUNK, **options):
    """A MiniCache after a ``ctx``-token prefill of random states, merged for real.

    The prompt is fed in blocks of ``chunk`` tokens, every layer per block (a chunked prefill), each
    pair merging each block: merging 64K tokens of a large batch at once needs several fp32 copies of
    the pair's states. After the prefill, ``merge_every`` is None: decoding merges nothing.

    With ``fused_decode`` the cache is marked as seen by the fused attention, as a prefill through the model
    would have left it: otherwise the first decode step restores layer 0 to bf16 before the attention is
    reached (64 MiB a sequence at 32K: the H200 run's 4-bit rows ran out of memory on it).
    """
    cache = MiniCache(cfg, merge_every=chunk, **options)
    cache.attention_hooked = bool(options.get("fused_decode"))
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


def prepare_fused(cache: MiniCache) -> MiniCache:
    """Build what the fused decode's first step would (each merged side's per-token factors and padded
    retained rows), so that ``stored_bytes`` counts it before a batch is sized by it."""
    for layer in cache.layers:
        if layer.role != "exact" and layer.pair.keys.merged_tokens:
            pair_state(layer.pair, layer.side)
    return cache


def quantized_cache(model, cfg, batch, ctx, device):
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


def pruned_cache(cfg, batch, kept, ctx, device):
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


class PinnedBuffer:
    """The pinned host buffer ShadowKV's offloaded values live in, page-locked on a thread of its own: pinning
    64 GiB took 28.4 s on the H200, which ``--part all`` spends beside the retrieval model's training."""

    def __init__(self, nbytes: int, pin: bool, log):
        self.nbytes, self.pin, self.log = nbytes, pin, log
        self._tensor, self._error = None, None
        self._thread = threading.Thread(target=self._allocate, name="pin-host-buffer", daemon=True)
        self._thread.start()

    def _allocate(self) -> None:
        t0 = time.perf_counter()
        try:
            # Page-locking faults every page in (zero-filled by the OS): no fill needed, decode cost ignores values.
            self._tensor = torch.empty(self.nbytes // 2, dtype=torch.bfloat16, pin_memory=self.pin)
        except Exception as exc:  # noqa: BLE001 - raised where the buffer is used
            self._error = exc
        self.seconds = round(time.perf_counter() - t0, 1)
        self.log(f"pinned {self.nbytes / GIB:.1f} GiB host buffer in {self.seconds}s")

    def get(self) -> torch.Tensor:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._tensor


def _host_gib(requested: float) -> float:
    """``requested`` GiB of pinned host memory, capped at 80% of what the host has available."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) / 2**20
    except (OSError, StopIteration):
        return requested
    return max(0.05, min(requested, 0.8 * avail))


def host_buffer_gib(args) -> float:
    """The pinned host buffer's size: ``--host-gib`` (capped at 80% of the host's free memory on a GPU run)."""
    return args.host_gib if args.smoke else _host_gib(args.host_gib)


def drop_captured_caches(model) -> None:
    """Drop the cache each attention module's routing hook kept from its last call (``_minicache_cache``,
    ``_shadowkv_cache``): after a failed attempt it is the whole failed cache, which a retry would build beside."""
    for mod in model.modules():
        for attr in ("_minicache_cache", "_shadowkv_cache"):
            if hasattr(mod, attr):
                delattr(mod, attr)


def release_memory(model, cuda: bool) -> None:
    """Free what a failed row attempt left: the hooks' references, the collectable garbage, the cached blocks."""
    drop_captured_caches(model)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
