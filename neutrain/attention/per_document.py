"""Causal attention within each document of packed rows, without a mask (:func:`packed_causal_attention`).

Why no mask: a block-diagonal mask keeps SDPA off its flash kernel and makes it compute every block of the row
(and under ``train.deterministic`` leaves a one-split kernel several times slower; ``neutrain.attention.packed``
says more). Here each document is its own causal attention:

* on a GPU, one launch of PyTorch's variable-length flash attention (``torch.nn.attention.varlen``) over the
  row's documents: only the blocks inside documents, and flash's backward (deterministic under
  ``torch.use_deterministic_algorithms``);
* elsewhere (a CPU, or a PyTorch without it), one SDPA call per document (``is_causal``, no mask).

Both compute the masked attention's values (to rounding: another summation order). ``neutrain_sdpa`` and the
calls ``neutrain_sage`` gives to SDPA both run packed causal rows here, through ``registration.exact_fallback``;
it is a module of its own because ``packed`` imports ``registration``, which imports this.
"""

from __future__ import annotations

import functools
import inspect
import weakref

import torch
import torch.nn.functional as F

from neutrain.attention.counters import count


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
