"""ShadowKV (arXiv 2410.21465): low-rank pre-RoPE keys, offloaded values, sparse decode.

Prefill is exact. Afterwards each layer keeps, on the device: a rank-``r`` SVD of
the pre-RoPE keys (``U`` shared across heads, ``SV`` per head), one landmark per
chunk of ``chunk_size`` tokens (mean of its post-RoPE keys), the exact K/V of the
``outliers`` chunks whose keys agree least with their landmark, and a local
window plus every generated token. Values go to pinned CPU memory (plain CPU
memory without CUDA, or the device with ``offload_values=False``).

Each decode step scores the landmarks with the query (softmax, summed over query
positions, max over the GQA group; Algorithm 2), takes the top-k chunks within the
budget, rebuilds their keys (``U[pos] @ SV``, then RoPE at the original
positions), gathers their values, and attends over
``[outliers | selected | local + generated]``. The selection needs the query,
which a ``Cache.update`` never sees, so the decode runs inside an attention
implementation registered as ``"shadowkv"``.

Defaults follow the paper: chunk 8, rank 160, budget 1.56% of the prompt (2048 of
128K), 48 outlier chunks, 4 local chunks, sparse only for prompts >= 4096 tokens.

One addition (``min_selected_chunks``, default 8): a budget that would select fewer than 8
chunks per head is spent in finer chunks instead (16 tokens: 8 chunks of 2), the outliers and
the local window keeping their token counts. Why: on SmolLM2 at 1,024 tokens the paper's 1.56%
is 16 tokens, 2 chunks of 8, and the landmarks found the needle's chunk in half the cases (55%
exact match against 100% full); in chunks of 2 the same 16 tokens scored 100%
(benchmarks/kv/NOTES.md). The paper never meets this: at its smallest sparse prompt (4,096
tokens) 1.56% is already 8 chunks. Finer chunks cost device memory (one landmark per chunk), so
chunks stay at least 2 tokens long (a 1-token chunk's landmark is the key itself).

Example:
    >>> import torch, transformers
    >>> cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    ...                                num_key_value_heads=2, intermediate_size=128, vocab_size=100)
    >>> model = transformers.AutoModelForCausalLM.from_config(cfg)
    >>> _ = enable_shadowkv(model, budget=16, rank=32, outliers=2, min_prefill=64)
    >>> cache = ShadowKVCache.for_model(model)
    >>> _ = model(torch.randint(0, 100, (1, 96)), past_key_values=cache, use_cache=True)
    >>> _ = model(torch.randint(0, 100, (1, 1)), past_key_values=cache, use_cache=True)
    >>> cache.counters["sparse_steps"] > 0
    True
    >>> disable_shadowkv(model)
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicLayer

from ... import compat
from .routing import route_attention, unroute_attention
from .shadowkv_fused_decode import FusedDecodeLayer
from .shadowkv_math import (apply_rope, chunk_tokens, invert_rope, low_rank_keys, pad_landmarks, rebuild_keys,
                            rope_cos_sin, select_chunks)

ATTN_NAME = "shadowkv"


@dataclass
class ShadowKVOptions:
    """ShadowKV knobs. ``budget`` < 1 is a fraction of the prompt, >= 1 a token count."""

    budget: float = 0.0156
    rank: int = 160
    chunk_size: int = 8
    outliers: int = 48
    local_chunks: int = 4
    min_prefill: int = 4096
    # Spend a budget of fewer than this many chunks in finer chunks (see the module docstring); 0: never.
    min_selected_chunks: int = 8
    offload_values: bool = True
    # Batch rows (the last ``device_value_rows`` of a batch) whose values stay on the device although
    # ``offload_values`` is on. Why: pinned host memory bounds how many sequences' values can be offloaded;
    # with GPU memory left over, a batch sized by the GPU keeps the overflow rows' values there.
    device_value_rows: int = 0
    # Diagnosis switches (where the accuracy goes): keep the selected chunks' keys exact instead of rebuilding them
    # from the rank-``rank`` SVD, so the selection's loss can be measured apart from the SVD's; and
    # log every step's selected chunks (``ShadowKVLayer.selection_log``) for the needle recall.
    exact_keys: bool = False
    log_selection: bool = False
    # Decode one-token steps through the Triton kernel of neutrain/kernels/shadowkv_fused_decode.py: the keys are
    # rebuilt inside the attention (never written out), one launch a layer, and the tail lives in a fixed-capacity
    # buffer with its length on the device, so the step reads no host-side length. Off until measured on a GPU.
    fused_decode: bool = False
    # Free tail slots the fused path's buffer is allocated with (it grows by reallocation when they run out;
    # a CUDA-graph capture needs them to cover the tokens it will generate).
    tail_capacity: int = 256
    # With fused_decode: the kernel reads the selected values where they are stored (the host rows' over PCIe from
    # pinned memory) instead of waiting for a separate gather, so the reads overlap the key rebuilds.
    fused_store_reads: bool = False


class ShadowKVLayer(FusedDecodeLayer, DynamicLayer):
    """One layer: dense until the attention function compresses the prefill, sparse after."""

    def __init__(self, owner: "ShadowKVCache"):
        super().__init__()
        self.owner = owner
        self.mode = "empty"  # -> "dense" after the first update -> "sparse" after compression
        self.seen = 0

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[-2]
        if self.mode == "sparse":
            if self.tail_len is not None:
                self.append_tail(key_states, value_states)
            else:
                self.tail_k = torch.cat([self.tail_k, key_states], dim=-2)
                self.tail_v = torch.cat([self.tail_v, value_states], dim=-2)
            return key_states, value_states
        self.mode = "dense"
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.seen

    def crop(self, *args, **kwargs):
        raise NotImplementedError("ShadowKV caches are built per request")

    # -- prefill compression
    def geometry(self, n: int) -> tuple[int, int, int]:
        """``(chunk size, outlier chunks, local tokens)`` for an ``n``-token prompt.

        The chunk size is ``chunk_size`` unless the budget would then select fewer than
        ``min_selected_chunks`` chunks; it is then the largest that selects that many, but at least 2.
        Outliers and the local window keep the tokens they cover in chunks of ``chunk_size``.

        Example:
            >>> from transformers import LlamaConfig
            >>> cache = ShadowKVCache(LlamaConfig(num_hidden_layers=1), budget=0.0156)
            >>> cache.layers[0].geometry(1024), cache.layers[0].geometry(131072)
            ((2, 192, 32), (8, 48, 32))
        """
        opt = self.owner.options
        cs, budget = opt.chunk_size, self.owner.budget_tokens(n)
        if opt.min_selected_chunks > 0 and budget < opt.min_selected_chunks * cs:
            # Not below 2: a chunk of one token makes its landmark the key itself (no keys saved).
            cs = max(min(2, cs), min(cs, budget // opt.min_selected_chunks))
        return cs, -(-opt.outliers * opt.chunk_size // cs), opt.local_chunks * opt.chunk_size

    def compress(self, rotary, position_ids: torch.Tensor | None) -> bool:
        """Build the shadow state from the exact prefill K/V; False (stay dense) if the prompt is too short."""
        opt = self.owner.options
        keys, values = self.keys, self.values
        b, h, n, d = keys.shape
        cs, outliers, local = self.geometry(n)
        num_chunks = (n - local) // cs
        if n < opt.min_prefill or num_chunks <= outliers:
            return False
        self.chunk_size = cs
        if cs < opt.chunk_size:
            self.owner.counters["refined_chunk_layers"] += 1
        ctx = num_chunks * cs
        positions = position_ids if position_ids is not None else torch.arange(n, device=keys.device)[None]
        self.pos0 = positions.reshape(-1, positions.shape[-1])[:, :1].to(keys.device)  # [1 or b, 1]
        cos, sin = rope_cos_sin(rotary, positions.expand(b, n) if positions.shape[0] == 1 else positions, keys.dtype)
        if opt.exact_keys:
            self.exact_k, self.u, self.sv = keys[:, :, : num_chunks * cs].clone(), None, None
        else:
            pre = invert_rope(keys.float(), cos[:, None].float(), sin[:, None].float())
            u, sv = low_rank_keys(pre, opt.rank)
            self.u, self.sv, self.exact_k = u.to(keys.dtype), sv.to(keys.dtype), None

        chunked = keys[:, :, :ctx].reshape(b, h, num_chunks, cs, d)
        landmarks = chunked.float().mean(dim=3)
        agreement = F.cosine_similarity(chunked.float(), landmarks[:, :, :, None], dim=-1).amin(dim=-1)
        outlier_ids = agreement.topk(outliers, dim=-1, largest=False).indices.sort(dim=-1).values
        self.outlier_ids, self.selection_log = outlier_ids, []
        keep = torch.ones(b, h, num_chunks, dtype=torch.bool, device=keys.device)
        keep.scatter_(-1, outlier_ids, False)
        self.landmark_chunk = keep.nonzero()[:, 2].view(b, h, num_chunks - outliers)
        self.landmarks = pad_landmarks(landmarks.gather(2, self.landmark_chunk[..., None].expand(-1, -1, -1, d))
                                       .to(keys.dtype))
        self.num_landmarks = num_chunks - outliers
        out_tok = chunk_tokens(outlier_ids, cs)[..., None].expand(-1, -1, -1, d)
        self.outlier_k, self.outlier_v = keys.gather(2, out_tok), values.gather(2, out_tok)
        self.tail_k, self.tail_v = keys[:, :, ctx:].clone(), values[:, :, ctx:].clone()

        self.offloaded = opt.offload_values
        ctx_values = values[:, :, :ctx]
        self.v_device = None  # [b_dev, h, ctx, d]: the rows kept on the device (device_value_rows)
        if self.offloaded:
            # Chunk-major rows so one gathered row is one chunk (the paper's CPU layout).
            on_host = b - min(b, opt.device_value_rows)
            rows = ctx_values[:on_host].reshape(on_host, h, num_chunks, cs * d)
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=rows.is_cuda)
            host.copy_(rows)
            self.v_store = host
            if on_host < b:
                self.v_device = ctx_values[on_host:].clone()
        else:
            self.v_store = ctx_values.clone()
        self.num_chunks, self.context = num_chunks, ctx
        self.select = max(1, min(self.owner.budget_tokens(n) // cs, num_chunks - outliers))
        self.keys = self.values = keys.new_empty(0)
        self.mode = "sparse"
        return True

    # -- decode
    def gather_values(self, chunk_ids: torch.Tensor, device):
        """Start gathering the selected chunks' values, [b, h, k * chunk, d] on ``device``.

        Returns ``(values, stream)``: on CUDA with offloaded values the gather runs on a
        side stream (the Triton kernel reading pinned host memory directly), and the
        caller makes its stream wait on ``stream`` after launching the key rebuild, so
        the PCIe reads overlap the rebuild. ``stream`` is None when nothing is pending.
        ``values`` is a list of batch-row blocks (host rows first) for the caller to join
        once ``stream`` is waited on.
        """
        b, h, k = chunk_ids.shape
        cs, d = self.chunk_size, self.tail_v.shape[-1]
        if not self.offloaded:
            tok = chunk_tokens(chunk_ids, cs)[..., None].expand(-1, -1, -1, d)
            return [self.v_store.gather(2, tok)], None
        if self.v_device is not None:  # mixed batch: host rows by the offload path, the rest on the device
            on_host = self.v_store.shape[0]
            # the host rows first, so their PCIe reads start before anything else; joined by the caller after the
            # key rebuild (joining here would make the main stream wait for them: no overlap)
            remote, pending = self._gather_offloaded(chunk_ids[:on_host], device) if on_host else (None, None)
            tok = chunk_tokens(chunk_ids[on_host:], cs)[..., None].expand(-1, -1, -1, d)
            local = self.v_device.gather(2, tok)
            return ([remote] if on_host else []) + [local], pending
        values, pending = self._gather_offloaded(chunk_ids, device)
        return [values], pending

    def _gather_offloaded(self, chunk_ids: torch.Tensor, device):
        b, h, k = chunk_ids.shape
        cs, d = self.chunk_size, self.tail_v.shape[-1]
        if device.type == "cuda" and not self.owner.uva_failed:
            try:
                from ...kernels.shadowkv import gather_chunks  # lazy: Triton, CUDA path only

                main, stream = torch.cuda.current_stream(device), self.owner.copy_stream(device)
                stream.wait_stream(main)  # the chunk ids are ready on the main stream
                with torch.cuda.stream(stream):
                    self.owner.mark("host_gather_start", stream)
                    rows = gather_chunks(self.v_store, chunk_ids)
                    self.owner.mark("host_gather_end", stream)
                rows.record_stream(main)
                self.owner.counters["uva_gathers"] += 1
                return rows.view(b, h, k * cs, d), stream
            except Exception:  # pragma: no cover - no UVA / no Triton: host-side gather below
                self.owner.uva_failed = True
        rows = self.v_store.gather(2, chunk_ids.to("cpu")[..., None].expand(-1, -1, -1, cs * d))
        return rows.to(device, non_blocking=False).view(b, h, k * cs, d), None

    def sparse_attention(self, module, query: torch.Tensor, rotary) -> torch.Tensor:
        """Attention of ``query`` [b, hq, m, d] over outliers + selected chunks + local/generated tokens."""
        b, hq, m, d = query.shape
        h = self.tail_k.shape[1]
        cs = self.chunk_size
        mark = self.owner.mark
        mark("start")
        picked = select_chunks(query, self.landmarks, self.select, module.scaling, self.num_landmarks)
        chunk_ids = self.landmark_chunk.gather(-1, picked)
        tokens = chunk_tokens(chunk_ids, cs)
        if self.owner.options.log_selection:
            self.selection_log.append(chunk_ids)
        mark("selection")
        fused = self.owner.options.fused_decode and m == 1 and self.exact_k is None
        if fused and self.owner.options.fused_store_reads and not self.owner.uva_failed:
            mark("gather_launch")  # nothing to gather: the kernel reads the stores
            return self.fused_attention(module, query, rotary, chunk_ids, None, None)
        blocks, pending = self.gather_values(chunk_ids, query.device)
        mark("gather_launch")
        if fused:
            return self.fused_attention(module, query, rotary, chunk_ids, blocks, pending)
        if self.exact_k is not None:
            keys_sel = self.exact_k.gather(2, tokens[..., None].expand(-1, -1, -1, d)).to(query.dtype)
        else:
            pre = rebuild_keys(self.u, self.sv, tokens)
            cos, sin = rope_cos_sin(rotary, tokens + self.pos0[:, :, None], pre.dtype)
            keys_sel = apply_rope(pre, cos, sin).to(query.dtype)
        mark("reconstruction")
        if pending is not None:
            torch.cuda.current_stream(query.device).wait_stream(pending)
        values_sel = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        mark("gather_wait")
        keys = torch.cat([self.outlier_k, keys_sel, self.tail_k], dim=2)
        values = torch.cat([self.outlier_v, values_sel, self.tail_v], dim=2)
        mask = None
        if m > 1:  # new tokens see each other causally; everything older is visible to all
            total = keys.shape[2]
            q_pos = torch.arange(m, device=query.device)[:, None] + (total - m)
            mask = torch.arange(total, device=query.device)[None, :] <= q_pos
        self.owner.counters["sparse_steps"] += 1
        self.owner.counters["selected_chunks"] += int(chunk_ids.numel())
        out = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=module.scaling, enable_gqa=hq != h
        )
        mark("attention")
        return out.transpose(1, 2).contiguous()

    # -- accounting
    def device_bytes(self) -> int:
        if self.mode != "sparse":
            return _nbytes(self.keys, self.values)
        parts = [self.u, self.sv, self.exact_k, self.landmarks, self.landmark_chunk, self.outlier_k, self.outlier_v,
                 *self.tail_tensors()]
        return _nbytes(*parts, getattr(self, "v_device", None)) + (0 if self.offloaded else _nbytes(self.v_store))

    def host_bytes(self) -> int:
        return _nbytes(self.v_store) if self.mode == "sparse" and self.offloaded else 0

    def full_bytes(self) -> int:
        ref = self.tail_k if self.mode == "sparse" else self.keys
        b, h, _, d = ref.shape
        return 2 * b * h * self.seen * d * ref.element_size()


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class ShadowKVCache(Cache):
    """A transformers ``Cache`` for models switched to ShadowKV with :func:`enable_shadowkv`.

    Attributes:
        counters: ``compressed_layers`` (prefills turned sparse), ``refined_chunk_layers`` (of those,
            the ones whose budget was spent in finer chunks: ``min_selected_chunks``), ``sparse_steps``
            (decode attentions on the sparse path), ``selected_chunks``, ``dense_prefill``
            (prompts left dense because they were too short), ``dense_steps`` and
            ``uva_gathers`` (value gathers by the Triton kernel from pinned host memory), ``fused_steps`` (of the
            sparse steps, those through ``shadowkv_fused_decode``: ``fused_decode``).
    """

    def __init__(self, config, **options):
        cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.options = ShadowKVOptions(**options)
        self.counters = dict.fromkeys(
            ("compressed_layers", "refined_chunk_layers", "sparse_steps", "selected_chunks", "dense_prefill",
             "dense_steps", "uva_gathers", "fused_steps"), 0
        )
        self.uva_failed = False
        self._copy_streams: dict = {}
        self.phase_events: list | None = None  # a list: decode steps record their phases (``mark``)
        super().__init__(layers=[ShadowKVLayer(self) for _ in range(cfg.num_hidden_layers)])

    @classmethod
    def for_model(cls, model) -> "ShadowKVCache":
        """A cache with the options given to :func:`enable_shadowkv` for ``model``."""
        return cls(model.config, **getattr(model, "_shadowkv_options", {}))

    def mark(self, name: str, stream=None) -> None:
        """Record a CUDA event named ``name`` (on ``stream``, else the current one) into ``phase_events`` while
        that is a list: the phases of a decode step, timed by ``kv_eval.py``. Does nothing otherwise."""
        if self.phase_events is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
            self.phase_events.append((name, event))

    def budget_tokens(self, prompt_len: int) -> int:
        budget = self.options.budget
        return int(round(budget * prompt_len)) if budget < 1 else int(budget)

    def copy_stream(self, device):
        if device not in self._copy_streams:
            self._copy_streams[device] = torch.cuda.Stream(device)
        return self._copy_streams[device]

    def stats(self) -> dict:
        """Counters, device/host bytes and the measured compression ratio of device KV."""
        dev = sum(layer.device_bytes() for layer in self.layers if layer.is_initialized)
        host = sum(layer.host_bytes() for layer in self.layers if layer.is_initialized)
        full = sum(layer.full_bytes() for layer in self.layers if layer.is_initialized)
        return {**self.counters, "device_bytes": dev, "host_bytes": host, "full_bytes": full,
                "compression_ratio": full / dev if dev else float("nan")}


# ---------------------------------------------------------------- attention hook-up
def shadowkv_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention implementation ``"shadowkv"``: exact prefill + compression, sparse decode.

    The argument order is transformers' (``dropout`` before ``scaling``, as ``sdpa_attention_forward``):
    wrappers that pass ``dropout`` positionally (kvpress patches every registered attention so) must land it there.
    """
    cache = getattr(module, "_shadowkv_cache", None)
    sdpa = compat.sdpa_attention()
    if not isinstance(cache, ShadowKVCache):
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    layer = cache.layers[module.layer_idx]
    if layer.mode == "sparse":
        return layer.sparse_attention(module, query, module._shadowkv_rotary), None
    out = sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    is_prefill = key.shape[2] == query.shape[2]
    if is_prefill and layer.compress(module._shadowkv_rotary, kwargs.get("position_ids")):
        cache.counters["compressed_layers"] += 1
    elif is_prefill:
        cache.counters["dense_prefill"] += 1
    else:
        cache.counters["dense_steps"] += 1
    return out


def _find_rotary(model):
    for mod in model.modules():
        if type(mod).__name__.endswith("RotaryEmbedding"):
            return mod
    raise ValueError("ShadowKV needs a model with a rotary embedding module")


def enable_shadowkv(model, budget: float = 0.0156, rank: int = 160, chunk_size: int = 8, outliers: int = 48,
                    **options):
    """Switch ``model`` to ShadowKV attention; decode with ``ShadowKVCache.for_model(model)``.

    Args:
        budget: Selected tokens per step: a fraction of the prompt (< 1) or a count.
        rank: SVD rank of the pre-RoPE keys.
        chunk_size: Tokens per chunk/landmark.
        outliers: Chunks kept exact on the device.
        **options: ``local_chunks``, ``min_prefill``, ``offload_values`` (see :class:`ShadowKVOptions`).

    Returns:
        The model (modified in place).
    """
    opts = asdict(ShadowKVOptions(budget=budget, rank=rank, chunk_size=chunk_size, outliers=outliers, **options))
    model._shadowkv_options = opts
    rotary = _find_rotary(model)
    route_attention(model, ATTN_NAME, shadowkv_attention, "shadowkv",
                    setup=lambda mod: setattr(mod, "_shadowkv_rotary", rotary))
    return model


def disable_shadowkv(model) -> None:
    """Undo :func:`enable_shadowkv`: remove hooks and restore the previous attention implementation."""
    unroute_attention(model, "shadowkv", module_attrs=("_shadowkv_rotary",), model_attrs=("_shadowkv_options",))


@contextmanager
def shadowkv_cache_factory(model, **options):
    """The registry's factory of ``"shadowkv"``: ShadowKV attention inside the block (``options`` of
    :func:`enable_shadowkv`), a :class:`ShadowKVCache` per sample."""
    enable_shadowkv(model, **options)
    try:
        yield lambda: ShadowKVCache.for_model(model)
    finally:
        disable_shadowkv(model)
