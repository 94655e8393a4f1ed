"""Exact causal attention over packed rows, one document at a time: ``attn_implementation="neutrain_sdpa"``.

Why: a packed row (``data.sample_packing``: documents laid end to end, ``position_ids`` restarting at each) reaches
SDPA as a block-diagonal mask. With a mask SDPA cannot run its flash kernel; the memory-efficient one it runs
computes every block of the row, masked or not, and under ``train.deterministic`` its only deterministic form is
one split: Llama-3-8B layers at 16K packed took 4.27x the default time (``benchmarks/notes_determinism.md``),
which put an exact resume of the 70B at 16K out of reach. Here each document is its own causal attention:

* on a GPU, one launch of PyTorch's variable-length flash attention (``torch.nn.attention.varlen``) over the
  row's documents: no mask, only the blocks inside documents, and flash's backward (deterministic under
  ``torch.use_deterministic_algorithms``);
* elsewhere (a CPU, or a PyTorch without it), one SDPA call per document (``is_causal``, no mask).

Both compute the masked attention's values (to rounding: another summation order); tests compare them with
the masked reference on generated layouts (``tests/unit/attention/test_packed_attention.py``).

Document boundaries are read on the host once per ``position_ids`` tensor (the segments are cached by
:func:`neutrain.attention.registration.packed_segments`, and their boundaries here by that tensor).
"""

from __future__ import annotations

import functools
import inspect
import weakref

import torch
import torch.nn.functional as F

from neutrain import compat
from neutrain.attention.counters import count
from neutrain.attention.registration import _fallback, _fallback_mask, neutrain_sage_mask, packed_segments

ATTENTION_NAME = "neutrain_sdpa"


class Documents:
    """The documents of packed rows: ``cu`` (int32 [D+1], offsets into the flattened ``B * N`` tokens), the
    longest's length, and the ``(row, start, end)`` of each (host ints, for the per-document path)."""

    def __init__(self, segments: torch.Tensor):
        batch, n = segments.shape
        starts = torch.ones_like(segments, dtype=torch.bool)
        starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
        flat = torch.nonzero(starts.reshape(-1)).reshape(-1)
        offsets = torch.cat([flat, flat.new_tensor([batch * n])]).tolist()  # the one host read
        self.spans = [(a // n, a % n, a % n + (b - a)) for a, b in zip(offsets[:-1], offsets[1:])]
        self.cu = torch.tensor(offsets, dtype=torch.int32, device=segments.device)
        self.longest = max(e - s for _, s, e in self.spans)


_LAST: tuple | None = None  # (weak reference to the segments tensor, its Documents): every layer's call reuses it


def documents(segments: torch.Tensor) -> Documents:
    """:class:`Documents` of ``segments`` (document ids [B, N]), read once per segments tensor."""
    global _LAST
    if _LAST is not None and _LAST[0]() is segments:
        return _LAST[1]
    docs = Documents(segments)
    _LAST = (weakref.ref(segments), docs)
    return docs


@functools.cache
def _varlen():
    """PyTorch's variable-length flash attention and how this version takes causality and GQA, or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)} if "window_size" in params \
        else None
    if causal is None:
        return None
    return varlen_attn, causal, "enable_gqa" in params


def varlen_available(query: torch.Tensor) -> bool:
    """Whether the one-launch path can run ``query``'s call (a CUDA bf16/fp16 tensor, head size at most 256)."""
    return (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and query.shape[-1] <= 256
            and _varlen() is not None)


def packed_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: torch.Tensor,
                            scale: float | None = None) -> torch.Tensor:
    """Causal attention within each document of packed rows.

    Args:
        query: [B, Hq, N, D]; key, value: [B, Hk, N, D] (``Hq`` a multiple of ``Hk``).
        segments: document ids [B, N], non-decreasing along each row.

    Returns:
        [B, N, Hq, D], transformers' attention-function layout.
    """
    docs = documents(segments)
    batch, heads, n, dim = query.shape
    groups = heads // key.shape[1]
    if varlen_available(query):
        varlen_attn, causal, native_gqa = _varlen()
        q = query.transpose(1, 2).reshape(batch * n, heads, dim)
        k, v = (t.transpose(1, 2).reshape(batch * n, t.shape[1], dim) for t in (key, value))
        gqa = {}
        if groups > 1 and native_gqa:
            gqa = {"enable_gqa": True}
        elif groups > 1:
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        out = varlen_attn(q, k, v, docs.cu, docs.cu, docs.longest, docs.longest, scale=scale, **causal, **gqa)
        count("packed_varlen")
        return out.reshape(batch, n, heads, dim)
    if groups > 1:
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    rows: list[list[torch.Tensor]] = [[] for _ in range(batch)]
    for row, start, end in docs.spans:
        rows[row].append(F.scaled_dot_product_attention(query[row:row + 1, :, start:end], key[row:row + 1, :, start:end],
                                                        value[row:row + 1, :, start:end], is_causal=True, scale=scale))
    count("packed_documents", len(docs.spans))
    return torch.cat([torch.cat(pieces, dim=2) for pieces in rows], dim=0).transpose(1, 2).contiguous()


def neutrain_sdpa_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                                    scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers attention function: packed causal rows one document at a time (:func:`packed_causal_attention`),
    every other call exactly as ``attn_implementation="sdpa"`` runs it."""
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    padding = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
    plain = not (dropout or kwargs.get("softcap") or kwargs.get("sliding_window") or kwargs.get("s_aux") is not None
                 or kwargs.get("output_attentions"))
    segments = packed_segments(kwargs.get("position_ids"), query.shape[0], kv_len) if q_len == kv_len else None
    if segments is not None and causal and attention_mask is None and plain:
        return packed_causal_attention(query, key, value, segments, scaling), None
    groups = query.shape[1] // key.shape[1]
    if segments is None and padding is None and getattr(module, "num_key_value_groups", 1) == groups and \
            attention_mask is None:
        return compat.sdpa_attention()(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                       is_causal=causal)
    mask = attention_mask if attention_mask is not None and padding is None else \
        _fallback_mask(q_len, kv_len, causal, padding, segments, kwargs.get("sliding_window"), query.device)
    if mask is not None and mask.dtype != torch.bool:  # an additive float mask
        mask = mask > torch.finfo(mask.dtype).min / 2
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return _fallback(query, key, value, mask, dropout, scaling, kwargs.get("softcap"), kwargs.get("s_aux")), None


def register() -> str:
    """Register ``"neutrain_sdpa"`` with transformers (idempotent) and return the name; its mask function is
    the padding-only one ``neutrain_sage`` uses (packed rows need none: the documents are read from positions)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, neutrain_sdpa_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, neutrain_sage_mask)
    return ATTENTION_NAME
