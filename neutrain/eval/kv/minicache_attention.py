"""MiniCache decode attention that reads the merged and 4-bit stores as they are kept.

Without it, every decode step restores each compressed layer to a full bf16 K/V (dequantize,
rescale the shared direction by the layer's norms, put the retained rows back, concatenate the
newest tokens) and then runs SDPA over that copy: MiniCache was slower than the cache it
compresses (0.2-0.45x the full cache's decode tokens/s). Here a decode token's attention is computed over *segments*
read in place by one Triton kernel (:mod:`neutrain.kernels.minicache_attention`):

* an exact 4-bit layer: its packed codes with their scales and minima, and its unquantized
  residual tokens;
* a merged layer: the pair's shared direction (4-bit or not) times a per-token factor, this
  layer's norm over the direction's norm (MiniCache's restore, Eq. 2, folded into the scores and
  the softmax weights); the retained tokens (exact rows) in their own padded segment, masked in
  the direction segment by a negative factor; and the layer's unmerged residual tokens.

The per-token factors and the retained rows are built once per merge (one pass over the
direction, ``block`` tokens at a time), not per step. Exact unquantized layers keep SDPA.
The switch is :func:`enable_minicache_attention` (``kv_cache_factory(model, "minicache")`` does it);
a :class:`~neutrain.eval.kv.MiniCache` then decodes through the kernel on CUDA (``fused_decode``).
Like ShadowKV's sparse decode, it takes unpadded batches (the evaluation loop's): no attention mask is read.

Example:
    >>> import torch, transformers
    >>> from neutrain.eval.kv import MiniCache
    >>> cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    ...                                num_key_value_heads=2, intermediate_size=128, vocab_size=100)
    >>> cache = MiniCache(cfg, start_layer=0, quant_bits=4, quant_group=8, merge_every=None)
    >>> _ = cache.update(torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16), 0)
    >>> _ = cache.update(torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16), 1)
    >>> segs = layer_segments(cache.layers[1])
    >>> out = decode_attention_reference(torch.randn(1, 4, 16), segs, 0.25)
    >>> out.shape, [s.keys.dtype for s in segs]
    (torch.Size([1, 4, 16]), [torch.uint8, torch.float32, torch.float32])
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ... import compat
from .minicache import MiniCache, MiniCacheLayer, _LayerPair
from .quant import PlainTokenStore, QuantizedTokenStore, dequantize
from .routing import route_attention, unroute_attention

ATTN_NAME = "minicache"


@dataclass
class Segment:
    """Tokens one decode query attends to, as stored.

    ``keys``/``values``: [b, h, n, d] rows, or [b, h, n, d/2] packed 4-bit codes when ``key_scale`` /
    ``value_scale`` are given (keys: per channel and group of ``key_group`` tokens, [b, h, n/g, 1, d];
    values: per token and group of ``value_group`` channels, [b, h, n, d/g, 1]). ``key_token_scale`` /
    ``value_token_scale``: [b, n] fp32 factors (a negative key factor masks the token). ``lengths``:
    [b] int32 valid tokens per batch row.
    """

    keys: torch.Tensor
    values: torch.Tensor
    key_scale: torch.Tensor | None = None
    key_min: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None
    value_min: torch.Tensor | None = None
    key_group: int = 1
    value_group: int = 1
    key_token_scale: torch.Tensor | None = None
    value_token_scale: torch.Tensor | None = None
    lengths: torch.Tensor | None = None


def store_segments(keys, values, key_factor=None, value_factor=None) -> list[Segment]:
    """Segments of a key store and a value store holding the same tokens (quantized part, then residual)."""
    if isinstance(keys, PlainTokenStore) and isinstance(values, PlainTokenStore):
        return [Segment(keys.data, values.data, key_token_scale=key_factor, value_token_scale=value_factor)]
    assert isinstance(keys, QuantizedTokenStore) and isinstance(values, QuantizedTokenStore)
    out, nq = [], keys.num_quantized
    assert values.num_quantized == nq, "keys and values are quantized in the same token groups"
    if nq:
        d = values.codes.shape[-1] * (2 if values.bits == 4 else 1)
        out.append(Segment(keys.codes, values.codes, keys.scale, keys.minimum, values.scale, values.minimum,
                           key_group=keys.group, value_group=min(values.group, d),
                           key_token_scale=None if key_factor is None else key_factor[:, :nq],
                           value_token_scale=None if value_factor is None else value_factor[:, :nq]))
    if keys.residual is not None and keys.residual.shape[-2]:
        out.append(Segment(keys.residual, values.residual,
                           key_token_scale=None if key_factor is None else key_factor[:, nq:],
                           value_token_scale=None if value_factor is None else value_factor[:, nq:]))
    return out


def _retained_union(pair: _LayerPair, batch: int, tokens: int, device) -> torch.Tensor:
    """[b, tokens] bool: tokens retained exactly in the keys or in the values stream (they differ)."""
    mask = torch.zeros(batch, tokens, dtype=torch.bool, device=device)
    for stream in (pair.keys, pair.values):
        if stream.retained_index:
            index = torch.cat(stream.retained_index, dim=-1).long()
            mask[index[0], index[1]] = True
    return mask


def pair_state(pair: _LayerPair, side: int) -> dict:
    """One side's per-token factors and padded retained rows, built once per merge and kept on the pair.

    A retained token's key *or* value is exact; its other half is the restored one. Both are written
    into the retained segment for every token retained in either stream, and the token is masked in
    the direction segment.
    """
    cached = pair.fused_state.get(side)
    if cached is not None:
        return cached
    ks, vs = pair.keys, pair.values
    factors = []
    for stream in (ks, vs):
        norms = torch.cat(stream.norms[side], dim=-1)
        factors.append(norms / stream.direction.token_norms().clamp_min(1e-30))
    kf, vf = factors
    b, s = kf.shape
    union = _retained_union(pair, b, s, kf.device)
    bi, ti = union.nonzero(as_tuple=True)
    state = {"key_factor": kf, "value_factor": vf, "retained": None}
    if bi.numel():
        slot_of = torch.full((b, s), -1, dtype=torch.long, device=kf.device)
        slot_of[bi, ti] = torch.arange(bi.numel(), device=kf.device)
        rows = []
        for stream, factor in ((ks, kf), (vs, vf)):
            restored = stream.direction.rows(bi, ti)
            restored = restored * factor[bi, ti][:, None, None].to(restored.dtype)
            if stream.retained_index:
                index = torch.cat(stream.retained_index, dim=-1).long()
                restored[slot_of[index[0], index[1]]] = torch.cat(stream.retained_rows[side])
            rows.append(restored)
        counts = union.sum(dim=1)
        start = torch.cumsum(counts, 0) - counts
        slot = torch.arange(bi.numel(), device=kf.device) - start[bi]
        width = int(counts.max())
        h, d = rows[0].shape[1:]
        padded = []
        for r in rows:
            buf = torch.zeros(b, h, width, d, dtype=r.dtype, device=r.device)
            buf[bi, :, slot] = r
            padded.append(buf)
        state["retained"] = Segment(padded[0], padded[1], lengths=counts.to(torch.int32))
        kf = kf.clone()
        kf[union] = -1.0  # masked in the direction segment: attended through the retained rows
        state["key_factor"] = kf
    pair.fused_state[side] = state
    return state


def layer_segments(layer: MiniCacheLayer) -> list[Segment]:
    """Everything ``layer`` attends to at a decode step, as segments read in place."""
    if layer.role == "exact":
        return store_segments(layer.key_store, layer.value_store)
    pair, side = layer.pair, layer.side
    out = []
    if pair.keys.merged_tokens:
        state = pair_state(pair, side)
        out += store_segments(pair.keys.direction, pair.values.direction, state["key_factor"], state["value_factor"])
        if state["retained"] is not None:
            out.append(state["retained"])
    if pair.keys.residual[side] is not None:
        out.append(Segment(pair.keys.residual[side], pair.values.residual[side]))
    return out


# ---------------------------------------------------------------- reference
def _segment_rows(seg: Segment) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Restored keys and values [b, h, n, d] (fp32) of one segment and its valid tokens [b, n]."""
    if seg.key_scale is not None:
        k = dequantize(seg.keys, seg.key_scale.float(), seg.key_min.float(), "channel", seg.key_group)
    else:
        k = seg.keys.float()
    if seg.value_scale is not None:
        v = dequantize(seg.values, seg.value_scale.float(), seg.value_min.float(), "token", seg.value_group)
    else:
        v = seg.values.float()
    b, _, n, _ = k.shape
    valid = torch.ones(b, n, dtype=torch.bool, device=k.device)
    if seg.key_token_scale is not None:
        valid &= seg.key_token_scale >= 0
        k = k * seg.key_token_scale.clamp_min(0)[:, None, :, None]
        v = v * seg.value_token_scale[:, None, :, None]
    if seg.lengths is not None:
        valid &= torch.arange(n, device=k.device)[None] < seg.lengths[:, None]
    return k, v, valid


def decode_attention_reference(query: torch.Tensor, segments: list[Segment], scaling: float) -> torch.Tensor:
    """Pure-PyTorch attention of ``query`` [b, hq, d] over ``segments`` (fp32 math), [b, hq, d] in its dtype.

    What the restore-then-SDPA path computes, written for any segment list: the kernel's reference.
    """
    parts = [_segment_rows(seg) for seg in segments]
    k = torch.cat([p[0] for p in parts], dim=2)
    v = torch.cat([p[1] for p in parts], dim=2)
    valid = torch.cat([p[2] for p in parts], dim=1)
    b, hq, d = query.shape
    h = k.shape[1]
    q = query.float().view(b, h, hq // h, d)
    scores = torch.einsum("bhgd,bhnd->bhgn", q, k) * scaling
    scores = scores.masked_fill(~valid[:, None, None], float("-inf"))
    out = torch.einsum("bhgn,bhnd->bhgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(b, hq, d).to(query.dtype)


# ---------------------------------------------------------------- attention hook-up
def minicache_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention implementation ``"minicache"``: SDPA, except a fused decode step of a MiniCache layer.

    Argument order as transformers' SDPA (``dropout`` before ``scaling``).
    """
    cache = getattr(module, "_minicache_cache", None)
    if isinstance(cache, MiniCache):
        cache.attention_hooked = True  # from now on the cache may hand decode steps to this function
        layer = cache.layers[module.layer_idx]
        if layer.pending_fused:
            from ...kernels.minicache_attention import decode_attention  # lazy: Triton, CUDA decode only

            layer.pending_fused = False
            b, hq, _, d = query.shape
            out = decode_attention(query[:, :, 0], layer_segments(layer), scaling)
            if layer.role == "second" and cache._merge_due(layer.pair):
                cache._merge(layer.pair)  # after this step's attention, as the restore path merges
            cache.fused_steps += 1
            return out.view(b, 1, hq, d), None
    return compat.sdpa_attention()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                   **kwargs)


def enable_minicache_attention(model):
    """Route ``model``'s attention through :func:`minicache_attention` (SDPA for anything but a MiniCache
    decode step). Returns the model; :func:`disable_minicache_attention` undoes it."""
    route_attention(model, ATTN_NAME, minicache_attention, "minicache")
    return model


def disable_minicache_attention(model) -> None:
    """Undo :func:`enable_minicache_attention`."""
    unroute_attention(model, "minicache")


@contextmanager
def minicache_cache_factory(model, **options):
    """The registry's factory of ``"minicache"``: :class:`MiniCache` (``options`` are its own) for ``model``, its
    attention routed to :func:`minicache_attention` inside the block (the fused decode attends over the stores
    as they are kept)."""
    enable_minicache_attention(model)
    try:
        yield lambda: MiniCache(model.config, **options)
    finally:
        disable_minicache_attention(model)
