"""How many sequences of one cache setting the card holds: the throughput part's batch, from what a sequence holds.

A row's batch is ``(card - weights - margin) // bytes per sequence``, where a sequence's bytes are

* what its cache **stores**, measured on a one-sequence build of the real cache (merged layers share one
  direction, 4-bit codes are packed two per byte, and a fused MiniCache decode's per-token factors and
  retained rows are built before the measurement, since the first decode step builds them);
* the transient peak of **building** it: the benchmark fills a cache with a chunked random prefill, and a
  merged pair's block goes through SLERP in fp32 (two fp32 copies of each side, their unit directions, the
  weighted sum), a quantized block through its min/max and codes, and every store grows by a copy of
  itself (``torch.cat``, or a larger buffer);
* the **decode** step's working memory: the logits, and for the restore path a bf16 copy of one layer's
  keys and values (unpacked codes, their bf16 copy, the dequantized and the concatenated tensor).

The 32K run on an H100 sized MiniCache by the stored bytes alone and ran out of memory at every batch it
tried for merge + 4-bit (67, 50, 37): each 4-bit store also kept its last appended block alive (fixed in
``neutrain/eval/kv/quant.py``) and the fp32 merge of 4,096-token blocks took ~190 MiB a sequence on top.
The block constants below were measured on CPU (``tests/unit/eval/test_kv_sizing.py`` holds the build to
them with a tracker of live tensor bytes) and rounded up.

The H200 run at d100cd9 ran the 4-bit MiniCache rows out of memory at every batch again (merge + 4-bit 125,
93, 69 at 32K). Two causes, neither in the stored bytes: the benchmark fills the cache without the model, so
the cache had not seen the fused attention, and the first decode step restored layer 0 to bf16 before the
attention took over (7.81 GiB at 125 sequences: 64 MiB, one layer's keys, a sequence); and a failed
attempt's cache stayed alive on the model's attention modules (the routing hook keeps the last cache it
saw), so every retry built beside it. The throughput part now marks its caches as seen by the fused
attention, drops the hook's reference before a retry (:func:`run_with_backoff` halves the batch down to 1),
and sizes the fused decode's first step (:func:`fused_decode_bytes_per_seq`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from neutrain.eval.kv.registry import kv_cache_specs

GIB = 2**30

# Bytes a chunked prefill holds beyond the stores, per element of one block (batch x chunk x kv heads x
# head dim), measured on CPU: 39 for a merged pair with 4-bit stores, 48 unquantized, 10 for 4-bit exact layers.
MERGE_BLOCK_BYTES = 48
QUANT_BLOCK_BYTES = 16
PLAIN_BLOCK_BYTES = 8
# The restore path's per-step copy of one compressed layer, per element of that layer's keys (and values): each
# cache's own cost, declared with it (restore_bytes, neutrain/eval/kv/registry.py).
RESTORE_BYTES = {spec.name: spec.restore_bytes for spec in kv_cache_specs() if spec.restore_bytes}


@dataclass
class Budget:
    """The GPU memory a row may fill: the card less the model's weights and a fixed margin (the CUDA context,
    cuBLAS workspaces, the allocator's rounding and fragmentation)."""

    card: int
    weights: int
    margin: int

    @property
    def headroom(self) -> int:
        return self.card - self.weights - self.margin

    def batch(self, per_seq: int, cap: int | None = None) -> int:
        """The largest batch whose sequences fit the headroom (at least 1; at most ``cap``)."""
        b = max(1, int(self.headroom // max(1, per_seq)))
        return min(b, cap) if cap else b

    def predicted_peak(self, batch: int, per_seq: int) -> int:
        """Bytes allocated at the row's peak if the per-sequence figure is right: weights plus the batch."""
        return self.weights + batch * per_seq


def kv_width(cfg) -> tuple[int, int]:
    """``(kv heads, head dim)`` of a model config."""
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_key_value_heads, d


def decode_bytes_per_seq(cfg, ctx: int, restore: str | None = None) -> int:
    """A decode step's working memory per sequence: the fp32 logits of the last position, the step's
    activations (a few hidden and MLP widths), and with ``restore`` (``"minicache"`` / ``"quantized"``) the
    per-step bf16 copy of one compressed layer."""
    heads, d = kv_width(cfg)
    logits = 4 * cfg.vocab_size
    activations = 4 * 2 * (4 * cfg.hidden_size + 2 * cfg.intermediate_size)
    copy = RESTORE_BYTES[restore] * heads * ctx * d if restore else 0
    return logits + activations + copy


# The fused decode's first step builds each merged side's per-token factors from the direction's token norms
# (``QuantizedTokenStore.token_norms``), dequantizing this many tokens at a time: per element the unpacked
# codes (1 byte and its two halves), the bf16 values, their scaled copy and an fp32 copy for the norm.
NORM_BLOCK_TOKENS = 4096
QUANT_NORM_BYTES = 10
PLAIN_NORM_BYTES = 4  # a plain direction's norm is taken over the whole stream at once, in fp32


def fused_decode_bytes_per_seq(cfg, ctx: int, quant_bits: int | None, merged: bool) -> int:
    """The first fused decode step's working memory per sequence: the logits and activations of any decode
    step, and the per-token factors of the merged sides, built from the direction's token norms (a block of
    dequantized tokens at a time for 4-bit stores, the whole stream in fp32 for plain ones). Nothing of a
    layer is restored: the cache must have seen the fused attention before the step (``_minicache`` marks it)."""
    heads, d = kv_width(cfg)
    norms = 0
    if merged:
        norms = (QUANT_NORM_BYTES * min(NORM_BLOCK_TOKENS, ctx) if quant_bits else PLAIN_NORM_BYTES * ctx) * heads * d
    return decode_bytes_per_seq(cfg, ctx) + norms


def minicache_transient_bytes_per_seq(cfg, ctx: int, chunk: int, quant_bits: int | None, merged: bool,
                                      fused: bool) -> int:
    """What a MiniCache row needs per sequence beyond its stored bytes: the larger of the chunked prefill's
    transient and the decode step's (fused, or the restore path's per-step bf16 copy of one layer)."""
    build = minicache_build_bytes_per_seq(cfg, ctx, chunk, quant_bits, merged)
    decode = fused_decode_bytes_per_seq(cfg, ctx, quant_bits, merged) if fused else \
        decode_bytes_per_seq(cfg, ctx, "minicache")
    return max(build, decode)


def minicache_build_bytes_per_seq(cfg, ctx: int, chunk: int, quant_bits: int | None, merged: bool) -> int:
    """The transient peak per sequence of filling a MiniCache with a chunked prefill of ``ctx`` tokens in
    blocks of ``chunk``: the block's working tensors (a merged pair's fp32 SLERP, or the quantization of an
    exact layer's block) plus the copy that grows the largest store by one block."""
    heads, d = kv_width(cfg)
    width = heads * d
    per_element = MERGE_BLOCK_BYTES if merged else QUANT_BLOCK_BYTES if quant_bits else PLAIN_BLOCK_BYTES
    grow = ctx * width * (2 if quant_bits is None else 1)  # a bf16 stream, or 4-bit codes with their ranges
    return per_element * min(chunk, ctx) * width + grow


def minicache_stored_bytes_per_token(cfg, quant_bits: int | None, quant_group: int, start_layer: int | None = None,
                                     retained_fraction: float = 0.0, dtype_bytes: int = 2) -> float:
    """Bytes MiniCache stores per token of one sequence, from the layout (what ``MiniCache.stored_bytes``
    measures, up to the retained tokens, which depend on the states): exact layers keep keys and values;
    each merged pair keeps one direction per stream, four fp32 norms, and ``retained_fraction`` of each
    stream's tokens exactly on both sides (rows and their int32 index).

    For a plan before anything is built (the tests size a fake Llama-3-8B with it); the benchmark sizes its
    rows by the measured figure.
    """
    heads, d = kv_width(cfg)
    width = heads * d
    layers = cfg.num_hidden_layers
    start = layers // 2 if start_layer is None else start_layer
    pairs = max(0, (layers - start) // 2)
    exact = layers - 2 * pairs

    def stream() -> float:  # one key or value stream of one layer, per token
        if quant_bits is None:
            return width * dtype_bytes
        group_dim = min(quant_group, d)
        codes = width * quant_bits / 8
        # keys: (scale, min) per channel and group of tokens; values: per token and group of channels
        key_ranges = 2 * dtype_bytes * width / quant_group
        value_ranges = 2 * dtype_bytes * heads * (d // group_dim)
        return codes + (key_ranges + value_ranges) / 2

    retained = retained_fraction * 2 * (2 * width * dtype_bytes + 8)  # per stream: both sides' rows, an int32 pair
    return exact * 2 * stream() + pairs * (2 * stream() + 4 * 4 + retained)


def run_with_backoff(batch: int, attempt: Callable[[int], dict], release: Callable[[], None],
                     log: Callable[[str], None] = lambda msg: None, label: str = "") -> tuple[dict, list[dict]]:
    """``attempt(batch)``, halving the batch after each out-of-memory error down to 1.

    ``release()`` runs after a failure and before the next try: it must drop every reference to the failed
    attempt's tensors (the H200 run's retries built beside the failed cache, which the model's attention hook
    still held, and failed at 3/4 and 9/16 of a batch that only a restored layer had overflowed). Returns the
    result and every attempt (``{"batch": b}``, with ``"error"`` where it failed); re-raises the error of batch 1.
    """
    import torch

    attempts: list[dict] = []
    while True:
        failure = None
        try:
            out = attempt(batch)
        except torch.OutOfMemoryError as exc:
            failure = f"OutOfMemoryError at batch {batch}: {str(exc)[:200]}"
        if failure is None:
            attempts.append({"batch": batch})
            return out, attempts
        # Outside the handler: the traceback, and the half-built cache its frames hold, are gone now.
        attempts.append({"batch": batch, "error": failure})
        release()
        if batch == 1:
            raise torch.OutOfMemoryError(failure)
        batch = max(1, batch // 2)
        log(f"{label}: {failure}; retrying at {batch}")
