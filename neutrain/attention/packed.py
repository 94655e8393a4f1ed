"""Exact causal attention over packed rows, one document at a time: ``attn_implementation="neutrain_sdpa"``.

Why: a packed row (``data.sample_packing``: documents laid end to end, ``position_ids`` restarting at each) reaches
SDPA as a block-diagonal mask. With a mask SDPA cannot run its flash kernel; the memory-efficient one it runs
computes every block of the row, masked or not, and under ``train.deterministic`` its only deterministic form is
one split: Llama-3-8B layers at 16K packed took 4.27x the default time (``benchmarks/training/NOTES.md``),
which put an exact resume of the 70B at 16K out of reach. Here each document is its own causal attention
(:func:`neutrain.attention.per_document.packed_causal_attention`): on a GPU one launch of PyTorch's variable-length
flash attention over the row's documents, elsewhere one SDPA call per document. Both compute the masked attention's
values (to rounding: another summation order); tests compare them with the masked reference on generated layouts
(``tests/unit/attention/test_packed_attention.py``).

Document boundaries are read on the host once per ``position_ids`` tensor (the segments are cached by
:func:`neutrain.attention.registration.packed_segments`, and their boundaries by that tensor).
"""

from __future__ import annotations

from neutrain import compat
from neutrain.attention.registration import exact_fallback, neutrain_sage_mask, packed_segments

ATTENTION_NAME = "neutrain_sdpa"


def neutrain_sdpa_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                                    scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers attention function: packed causal rows one document at a time (:func:`exact_fallback`),
    every other call exactly as ``attn_implementation="sdpa"`` runs it."""
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    segments = packed_segments(kwargs.get("position_ids"), query.shape[0], kv_len) if q_len == kv_len else None
    groups = query.shape[1] // key.shape[1]
    if segments is None and attention_mask is None and getattr(module, "num_key_value_groups", 1) == groups:
        return compat.sdpa_attention()(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                       is_causal=causal)
    return exact_fallback(query, key, value, attention_mask, segments, causal, dropout, scaling, kwargs), None


def register() -> str:
    """Register ``"neutrain_sdpa"`` with transformers (idempotent) and return the name; its mask function is
    the padding-only one ``neutrain_sage`` uses (packed rows need none: the documents are read from positions)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, neutrain_sdpa_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, neutrain_sage_mask)
    return ATTENTION_NAME
