"""MiniCache (arXiv 2405.14366): merge the KV states of adjacent layers in depth.

From layer ``S = L // 2`` up, layers are paired (S, S+1), (S+2, S+3), ... For each
token, the two layers' states (one vector over all heads x head_dim) are split
into direction and norm; the directions are merged by SLERP with parameter ``t``
(Eq. 3), the two norms are kept, and the pair is restored on read by rescaling
the shared direction with each layer's norm (Eq. 2). Token pairs whose directions
differ most (angular distance d = Omega / pi) are retained exactly.

Retention rule. Eq. 4 as printed keeps ``d < d_min + (d_max - d_min) * gamma``,
i.e. the most *similar* pairs, which merging already reconstructs well; the
text's stated aim is to keep the most *distinct* ones. ``retain="distinct"``
(default) keeps ``d >= d_max - (d_max - d_min) * gamma``; ``retain="literal"``
reproduces the printed rule. ``gamma = 0`` merges every pair. A unit test shows
the distinct rule gives the lower reconstruction error.

New tokens of a pair stay exact in a residual until ``merge_every`` of them are
present in both layers, then they are merged as one block (the prompt is one
block at prefill). With ``quant_bits=4`` every stored stream (exact layers and
merged directions) is KIVI-quantized: keys per channel, values per token.

Example:
    >>> import torch, transformers
    >>> cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    ...                                num_key_value_heads=2, intermediate_size=128, vocab_size=100)
    >>> model = transformers.AutoModelForCausalLM.from_config(cfg)
    >>> cache = MiniCache(cfg, merge_every=8)
    >>> _ = model(torch.randint(0, 100, (1, 32)), past_key_values=cache, use_cache=True)
    >>> cache.merges > 0 and cache.get_seq_length() == 32
    True
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .quant import make_store


def per_token(x: torch.Tensor) -> torch.Tensor:
    """[b, h, s, d] -> [b, s, h*d]: MiniCache's norms and angles are over the whole token vector."""
    b, h, s, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(b, s, h * d)


def from_per_token(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of :func:`per_token`."""
    b, s, hd = x.shape
    return x.view(b, s, heads, hd // heads).permute(0, 2, 1, 3)


def mean_direction_cosine(x_prev: torch.Tensor, x_next: torch.Tensor) -> float:
    """Mean over tokens of the cosine between two layers' per-token state vectors ([b, h, s, d] each)."""
    return float(torch.nn.functional.cosine_similarity(per_token(x_prev).float(), per_token(x_next).float(), dim=-1).mean())


def slerp_merge(x_prev: torch.Tensor, x_next: torch.Tensor, t: float, eps: float = 1e-6):
    """SLERP of per-token directions (Eq. 3), in fp32.

    Args:
        x_prev: Layer l-1 states, [b, s, n].
        x_next: Layer l states, [b, s, n].
        t: Interpolation weight towards layer l (paper: 0.6).

    Returns:
        ``(e, norm_prev, norm_next, omega)``: merged direction [b, s, n], the two
        per-token norms [b, s] and the angle Omega [b, s] in radians.
    """
    a, c = x_prev.float(), x_next.float()
    norm_prev = a.norm(dim=-1)
    norm_next = c.norm(dim=-1)
    u_prev = a / norm_prev.clamp_min(1e-30)[..., None]
    u_next = c / norm_next.clamp_min(1e-30)[..., None]
    cos = (u_prev * u_next).sum(-1).clamp(-1.0, 1.0)
    omega = torch.arccos(cos)
    sin = torch.sin(omega)
    # Near-parallel directions: SLERP's weights are 0/0; its limit is the linear interpolation.
    tiny = sin < eps
    safe = torch.where(tiny, torch.ones_like(sin), sin)
    w_prev = torch.where(tiny, torch.full_like(sin, 1.0 - t), torch.sin((1.0 - t) * omega) / safe)
    w_next = torch.where(tiny, torch.full_like(sin, t), torch.sin(t * omega) / safe)
    e = w_prev[..., None] * u_prev + w_next[..., None] * u_next
    return e, norm_prev, norm_next, omega


def retention_mask(omega: torch.Tensor, gamma: float, rule: str = "distinct") -> torch.Tensor:
    """Which token pairs to keep exactly, from angular distances d = Omega / pi ([b, s] -> bool [b, s]).

    ``distinct``: d >= d_max - (d_max - d_min) * gamma (the method's intent).
    ``literal``: d < d_min + (d_max - d_min) * gamma (Eq. 4 as printed).
    ``gamma == 0`` keeps nothing under either rule.
    """
    if gamma <= 0:
        return torch.zeros_like(omega, dtype=torch.bool)
    d = omega / math.pi
    d_min = d.amin(dim=-1, keepdim=True)
    d_max = d.amax(dim=-1, keepdim=True)
    if rule == "distinct":
        return d >= d_max - (d_max - d_min) * gamma
    if rule == "literal":
        return d < d_min + (d_max - d_min) * gamma
    raise ValueError(f"unknown retention rule {rule!r}")


class _MergedStream:
    """One merged stream (keys or values) of a layer pair: direction, norms, retained rows, residuals."""

    def __init__(self, axis: str, quant_bits, quant_group):
        self.direction = make_store(quant_bits, axis, quant_group)
        self.norms: list[list[torch.Tensor]] = [[], []]
        self.retained_index: list[torch.Tensor] = []  # [2, n] (batch, token) pairs, int32
        self.retained_rows: list[list[torch.Tensor]] = [[], []]  # [n, h, d] per side
        self.residual: list[torch.Tensor | None] = [None, None]
        self.merged_tokens = 0
        # The restored direction and its per-token norms, read for the pair's first layer and reused by
        # its second in the same forward (the direction only changes in ``merge``, which drops it).
        self._shared: tuple[torch.Tensor, torch.Tensor] | None = None

    def push(self, side: int, x: torch.Tensor) -> None:
        r = self.residual[side]
        self.residual[side] = x if r is None else torch.cat([r, x], dim=-2)

    def residual_length(self) -> int:
        return min(0 if r is None else r.shape[-2] for r in self.residual)

    def merge(self, t: float, gamma: float, rule: str) -> int:
        """Merge the residual block of both sides; returns the number of retained tokens."""
        x_prev, x_next = self.residual
        heads = x_prev.shape[1]
        e, n_prev, n_next, omega = slerp_merge(per_token(x_prev), per_token(x_next), t)
        keep = retention_mask(omega, gamma, rule)
        batch_idx, tok_idx = keep.nonzero(as_tuple=True)
        self.retained_index.append(torch.stack([batch_idx, tok_idx + self.merged_tokens]).to(torch.int32))
        for side, x in enumerate((x_prev, x_next)):
            self.retained_rows[side].append(x[batch_idx, :, tok_idx, :])
        self.norms[0].append(n_prev)
        self.norms[1].append(n_next)
        self.direction.append(from_per_token(e.to(x_prev.dtype), heads).contiguous())
        self.merged_tokens += x_prev.shape[-2]
        self.residual = [None, None]
        self._shared = None
        return int(batch_idx.numel())

    def read(self, side: int) -> torch.Tensor:
        """Restore this side's states: direction x (norm / |direction|), retained rows, then residual.

        Written into one preallocated output: one pass over the merged prefix to get
        the per-token norms of the direction, one to write the rescaled states, plus
        the (small) residual and retained rows; decode calls this every step.
        """
        residual = self.residual[side]
        if not self.merged_tokens:
            return residual
        if side == 1 and self._shared is not None:
            (e, e_norm), self._shared = self._shared, None
        else:
            e = self.direction.read()
            e_norm = torch.linalg.vector_norm(e, dim=(1, 3), dtype=torch.float32)  # [b, s]
            self._shared = (e, e_norm) if side == 0 else None
        b, h, s, d = e.shape
        extra = 0 if residual is None else residual.shape[-2]
        out = torch.empty(b, h, s + extra, d, dtype=e.dtype, device=e.device)
        scale = torch.cat(self.norms[side], dim=-1) / e_norm.clamp_min(1e-30)
        torch.mul(e, scale[:, None, :, None].to(e.dtype), out=out[:, :, :s])
        index = torch.cat(self.retained_index, dim=-1).long()
        if index.numel():
            out[index[0], :, index[1], :] = torch.cat(self.retained_rows[side])
        if extra:
            out[:, :, s:] = residual
        return out

    @property
    def nbytes(self) -> int:
        tensors = [*self.norms[0], *self.norms[1], *self.retained_index, *self.retained_rows[0], *self.retained_rows[1]]
        tensors += [r for r in self.residual if r is not None]
        return self.direction.nbytes + sum(x.numel() * x.element_size() for x in tensors)


class _LayerPair:
    def __init__(self, quant_bits, quant_group):
        self.keys = _MergedStream("channel", quant_bits, quant_group)
        self.values = _MergedStream("token", quant_bits, quant_group)
        self.layers: list["MiniCacheLayer"] = []
        self.similarity: float | None = None  # min of the keys' and values' mean cosine at the first merge
        # Per side: the fused decode's per-token factors and padded retained rows (minicache_attention.pair_state),
        # built at the first decode step after a merge and dropped by the next merge.
        self.fused_state: dict[int, dict] = {}


class MiniCacheLayer(DynamicLayer):
    """One layer of a :class:`MiniCache`: exact, or one side of a merged pair.

    ``get_seq_length`` reports the logical token count, so masks and positions
    are those of a full cache.
    """

    def __init__(self, owner: "MiniCache", role: str, pair: _LayerPair | None = None):
        super().__init__()
        self.owner, self.role, self.pair = owner, role, pair
        self.side = 1 if role == "second" else 0
        if role == "exact":
            self.key_store = make_store(owner.quant_bits, "channel", owner.quant_group)
            self.value_store = make_store(owner.quant_bits, "token", owner.quant_group)
        self.seen = 0
        self.pending_fused = False  # update stored a decode token without reading: the attention reads the stores

    def lazy_initialization(self, key_states, value_states) -> None:
        super().lazy_initialization(key_states, value_states)

    def become_exact(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Leave the pair: store this layer's states (so far ``keys``/``values``) exactly from now on."""
        self.role, self.pair = "exact", None
        self.key_store = make_store(self.owner.quant_bits, "channel", self.owner.quant_group)
        self.value_store = make_store(self.owner.quant_bits, "token", self.owner.quant_group)
        self.key_store.append(keys)
        self.value_store.append(values)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[-2]
        fused = self.owner._fused_now(key_states)
        storing = self.owner._storing  # MiniCache.store: nobody reads this step's states
        if self.role == "exact":
            self.key_store.append(key_states)
            self.value_store.append(value_states)
            if fused and self.owner.quant_bits is not None:  # unquantized exact layers: SDPA reads them as they are
                self.pending_fused = True
                return key_states, value_states
            return (key_states, value_states) if storing else (self.key_store.read(), self.value_store.read())
        self.pair.keys.push(self.side, key_states)
        self.pair.values.push(self.side, value_states)
        if fused:  # the attention reads the stores and merges after it, if due (minicache_attention)
            self.pending_fused = True
            return key_states, value_states
        if storing:
            keys, values = key_states, value_states
        else:
            keys, values = self.pair.keys.read(self.side), self.pair.values.read(self.side)
        # Layer l runs after layer l-1 in the same forward, so both residuals are complete here;
        # this step's attention already has the exact states, the merge only changes storage.
        if self.role == "second" and self.owner._merge_due(self.pair):
            self.owner._merge(self.pair)
        return keys, values

    def get_seq_length(self) -> int:
        return self.seen

    def reset(self) -> None:
        raise NotImplementedError("MiniCache is built per request; create a new one instead of resetting")

    def crop(self, *args, **kwargs) -> None:
        raise NotImplementedError("MiniCache does not support cropping (merged states are shared by two layers)")

    @property
    def nbytes(self) -> int:
        if self.role == "exact":
            return self.key_store.nbytes + self.value_store.nbytes
        # A pair's storage is counted once, on its first layer; the fused decode's factors and retained rows too.
        if self.role != "first":
            return 0
        fused = [t for state in self.pair.fused_state.values() for t in _tensors(state)]
        return self.pair.keys.nbytes + self.pair.values.nbytes + sum(t.numel() * t.element_size() for t in fused)


def _tensors(state) -> list[torch.Tensor]:
    """The tensors of a fused state (tensors, and the tensor fields of a segment)."""
    out = []
    for value in state.values():
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif value is not None:
            out += [t for t in vars(value).values() if isinstance(t, torch.Tensor)]
    return out


class MiniCache(Cache):
    """A transformers ``Cache`` that merges adjacent layers' KV from layer ``start_layer`` up.

    Args:
        config: The model config (number of layers).
        start_layer: First layer of the first merged pair; default ``L // 2``. ``>= L`` disables merging.
        t: SLERP weight towards the later layer of a pair (paper: 0.6).
        gamma: Retention threshold (paper: 0.05). 1 keeps every token exactly, 0 none.
        retain: ``"distinct"`` (intended) or ``"literal"`` (Eq. 4 as printed).
        merge_every: Decode tokens gathered before they are merged (the prompt merges at once). None:
            merge the prompt only; generated tokens stay exact (no merge work while decoding).
        min_similarity: None merges every pair (the paper). A number: at a pair's first merge (the
            prompt), the mean cosine of the two layers' per-token key and value directions is measured,
            and a pair whose lower one is below it is not merged (both layers stay exact, quantized if
            ``quant_bits``). Why: merging dissimilar layers loses what the model retrieves with; how
            similar adjacent layers are depends on the model (benchmarks/kv/NOTES.md).
        quant_bits: None, or 4 for KIVI-style quantization of every stored stream.
        quant_group: KIVI group size (tokens per block; channels per group for values).
        fused_decode: Decode steps attend over the stores in place (one Triton kernel,
            :mod:`neutrain.eval.kv.minicache_attention`) instead of restoring a bf16 copy of every
            compressed layer per step. None: on CUDA. Only once the model's attention is
            ``enable_minicache_attention``'s (the cache sees it at the prefill); otherwise the restore path.

    Attributes:
        merges: Number of merged blocks (one per pair and flush); > 0 proves the merge path ran.
        merged_tokens: Token positions merged, summed over pairs.
        unmerged_pairs: Pairs left exact by ``min_similarity``.
        retained_tokens: Token rows kept exactly, summed over pairs and over keys/values.
        fused_steps: Layer decode steps that ran the fused attention (> 0 proves the kernel path ran).
    """

    def __init__(self, config, start_layer: int | None = None, t: float = 0.6, gamma: float = 0.05,
                 retain: str = "distinct", merge_every: int | None = 64, quant_bits: int | None = None,
                 quant_group: int = 128, min_similarity: float | None = None, fused_decode: bool | None = None):
        cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        num_layers = cfg.num_hidden_layers
        self.start_layer = num_layers // 2 if start_layer is None else start_layer
        self.t, self.gamma, self.retain = t, gamma, retain
        self.merge_every, self.quant_bits, self.quant_group = merge_every, quant_bits, quant_group
        self.min_similarity, self.fused_decode = min_similarity, fused_decode
        self.merges = self.merged_tokens = self.retained_tokens = self.unmerged_pairs = self.fused_steps = 0
        self.attention_hooked = False  # set by minicache_attention when the model's attention is that one
        self._storing = False
        layers: list[MiniCacheLayer] = []
        idx = 0
        while idx < num_layers:
            if idx >= self.start_layer and idx + 1 < num_layers:
                pair = _LayerPair(quant_bits, quant_group)
                pair.layers = [MiniCacheLayer(self, "first", pair), MiniCacheLayer(self, "second", pair)]
                layers += pair.layers
                idx += 2
            else:
                layers.append(MiniCacheLayer(self, "exact"))
                idx += 1
        super().__init__(layers=layers)

    def _merge_due(self, pair: _LayerPair) -> bool:
        pending = pair.keys.residual_length()
        if self.merge_every is None:  # prompt only: the pair's first block
            return pending > 0 and pair.keys.merged_tokens == 0 and pair.similarity is None
        return pending >= self.merge_every

    def _fused_now(self, key_states: torch.Tensor) -> bool:
        """Whether this update is a decode token the fused attention will read from the stores."""
        on = key_states.is_cuda if self.fused_decode is None else self.fused_decode
        return on and self.attention_hooked and key_states.shape[-2] == 1

    def _merge(self, pair: _LayerPair) -> None:
        pair.fused_state = {}
        if self.min_similarity is not None and pair.similarity is None:
            (k0, k1), (v0, v1) = pair.keys.residual, pair.values.residual
            pair.similarity = min(mean_direction_cosine(k0, k1), mean_direction_cosine(v0, v1))
            if pair.similarity < self.min_similarity:
                for side, layer in enumerate(pair.layers):
                    layer.become_exact(pair.keys.residual[side], pair.values.residual[side])
                self.unmerged_pairs += 1
                return
        self.merged_tokens += pair.keys.residual_length()
        for stream in (pair.keys, pair.values):
            self.retained_tokens += stream.merge(self.t, self.gamma, self.retain)
        self.merges += 1

    def stored_bytes(self) -> int:
        """Bytes of every tensor the cache holds (measured, not a formula)."""
        return sum(layer.nbytes for layer in self.layers)

    def full_bytes(self) -> int:
        """Bytes a full ``DynamicCache`` would hold for the same tokens, in the same dtype."""
        total = 0
        for layer in self.layers:
            ref = layer.keys
            if layer.is_initialized and ref is not None:
                total += 2 * layer.seen * self._row_elems[0] * ref.element_size()
        return total

    def stats(self) -> dict:
        """Merge counters, bytes and the measured compression ratio (full bytes / stored bytes)."""
        stored, full = self.stored_bytes(), self.full_bytes()
        return {
            "merges": self.merges,
            "merged_tokens": self.merged_tokens,
            "retained_tokens": self.retained_tokens,
            "unmerged_pairs": self.unmerged_pairs,
            "stored_bytes": stored,
            "full_bytes": full,
            "compression_ratio": full / stored if stored else float("nan"),
        }

    def store(self, key_states, value_states, layer_idx: int) -> None:
        """``update`` without reading the layer's states back (merging as ``update`` does): for filling a cache
        whose attention is computed elsewhere, e.g. a benchmark's random prefill, without a restored copy."""
        self._storing = True
        try:
            self.update(key_states, value_states, layer_idx)
        finally:
            self._storing = False

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        b, h, _, d = key_states.shape
        self._row_elems = (b * h * d,)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)
