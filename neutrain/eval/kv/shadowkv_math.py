"""ShadowKV's tensor math: RoPE and its inverse, the low-rank key factorisation, landmark
scoring and chunk selection, key rebuilding. Pure functions of tensors, no cache state:
the cache that uses them is :mod:`neutrain.eval.kv.shadowkv`, and these are also the
references its tests check against.

Example:
    >>> import torch
    >>> chunk_tokens(torch.tensor([[[0, 2]]]), 4).tolist()
    [[[0, 1, 2, 3, 8, 9, 10, 11]]]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama RoPE, ``x * cos + rotate_half(x) * sin`` (cos/sin broadcast to x)."""
    return x * cos + rotate_half(x) * sin


def rope_cos_sin(rotary, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for integer ``positions`` of any shape ([..., head_dim]), from a model's rotary module.

    Same arithmetic as transformers' Llama rotary forward (fp32 angles, times
    ``attention_scaling``, cast to ``dtype``), but elementwise: that forward only
    takes [batch, seq] positions in 5.17, while selected chunks have one position
    per (batch, head, token).
    """
    inv_freq = rotary.inv_freq.to(device=positions.device, dtype=torch.float32)
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = getattr(rotary, "attention_scaling", 1.0)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def invert_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo :func:`apply_rope`: rotate back and divide by cos^2 + sin^2 (the rope scaling squared)."""
    return (x * cos - rotate_half(x) * sin) / (cos * cos + sin * sin)


def low_rank_keys(pre_rope_keys: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SVD of ``[b, h, n, d]`` keys flattened over heads: ``U`` [b, n, r] (shared), ``SV`` [b, h, r, d].

    The decomposition runs in fp32, as in the paper; ``U @ SV`` per head gives the keys back.
    """
    b, h, n, d = pre_rope_keys.shape
    flat = pre_rope_keys.permute(0, 2, 1, 3).reshape(b, n, h * d).float()
    u, s, vh = torch.linalg.svd(flat, full_matrices=False)
    r = min(rank, s.shape[-1])
    sv = (s[..., :r, None] * vh[..., :r, :]).view(b, r, h, d).permute(0, 2, 1, 3)
    return u[..., :r].to(pre_rope_keys.dtype).contiguous(), sv.to(pre_rope_keys.dtype).contiguous()


LANDMARK_ALIGN = 8
"""Landmarks are stored padded to a multiple of this many (zero rows past the real ones): the scores' product
writes one row of ``C`` scores per query, and at 64K ``C`` is 8,140 (8,188 chunks less 48 outliers), rows
16-byte misaligned, for which cuBLAS fell back to a 2-element-aligned CUTLASS GEMM: 314 us a layer at batch 32
on an H200, against 175 us for the same product at an aligned count (``benchmarks/kv/shadowkv_selection_probe.py``)."""


def pad_landmarks(landmarks: torch.Tensor) -> torch.Tensor:
    """``[b, h, C, d]`` -> ``[b, h, C', d]`` with ``C'`` the next multiple of :data:`LANDMARK_ALIGN`, zeros after."""
    extra = -landmarks.shape[2] % LANDMARK_ALIGN
    return F.pad(landmarks, (0, 0, 0, extra)) if extra else landmarks


def select_chunks(query: torch.Tensor, landmarks: torch.Tensor, k: int, scaling: float,
                  count: int | None = None) -> torch.Tensor:
    """Top-``k`` landmark indices per KV head (Algorithm 2): softmax(qL^T), sum over queries, max over group.

    Args:
        query: [b, hq, m, d].
        landmarks: [b, h, C, d] with hq a multiple of h.
        count: the real landmarks, the first ``count`` of ``C`` (:func:`pad_landmarks`); None: all ``C``.
    Returns:
        [b, h, k] indices into the landmark axis.
    """
    b, hq, m, d = query.shape
    h = landmarks.shape[1]
    q = query.reshape(b, h, hq // h, m, d).to(landmarks.dtype).contiguous()  # one layout for the product
    # Scores in the storage dtype (bf16 on GPU: reading landmarks dominates), softmax in fp32.
    logits = torch.einsum("bhgmd,bhcd->bhgmc", q, landmarks).float()
    if count is not None and count < logits.shape[-1]:
        logits = logits[..., :count]  # the padding's scores: not landmarks
    probs = torch.softmax(logits * scaling, dim=-1)
    # One query token (every decode step): its sum over queries is itself, so no reduction kernel runs for it.
    summed = probs[:, :, :, 0] if m == 1 else probs.sum(dim=3)
    scores = summed.amax(dim=2)
    return scores.topk(k, dim=-1).indices


def chunk_tokens(chunk_ids: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[..., k] chunk ids -> [..., k * chunk_size] token indices."""
    offs = torch.arange(chunk_size, device=chunk_ids.device)
    return (chunk_ids[..., None] * chunk_size + offs).flatten(-2)


def rebuild_keys(u: torch.Tensor, sv: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE keys of ``tokens`` ([b, h, t]) from ``U`` [b, n, r] and ``SV`` [b, h, r, d]: [b, h, t, d]."""
    b, h, t = tokens.shape
    rows = u[torch.arange(b, device=u.device)[:, None, None], tokens]  # [b, h, t, r]
    return torch.matmul(rows, sv)


def shadowkv_fused_decode_reference(query, u, sv, chunk_ids, values_sel, outlier_k, outlier_v, tail_k, tail_v,
                                    tail_len, pos0, rotary, chunk_size: int, scaling: float,
                                    value_stores=None) -> torch.Tensor:
    """What :func:`neutrain.kernels.shadowkv_fused_decode.shadowkv_fused_decode` computes, with the cache's
    unfused arithmetic: keys rebuilt (:func:`rebuild_keys`), RoPE'd at ``token + pos0``, concatenated after the
    outliers and before the first ``tail_len`` tail tokens, then SDPA; with ``value_stores`` the selected values
    gathered from them first. Same arguments; [b, hq, d]."""
    b, hq, d = query.shape
    h = chunk_ids.shape[1]
    tokens = chunk_tokens(chunk_ids, chunk_size)
    if value_stores is not None:
        rows = [s.reshape(s.shape[0], h, -1, d) for s in value_stores if s is not None]  # [rows, h, ctx, d] each
        store = torch.cat([r.to(query.device) for r in rows])
        values_sel = store.gather(2, tokens[..., None].expand(-1, -1, -1, d))
    pre = rebuild_keys(u, sv, tokens)
    cos, sin = rope_cos_sin(rotary, tokens + pos0.reshape(-1, 1, 1), pre.dtype)
    keys_sel = apply_rope(pre, cos, sin).to(query.dtype)
    n_tail = tail_k.shape[2] if tail_len is None else int(tail_len.reshape(-1)[0])  # a host read: reference only
    keys = torch.cat([outlier_k, keys_sel, tail_k[:, :, :n_tail]], dim=2)
    values = torch.cat([outlier_v, values_sel, tail_v[:, :, :n_tail]], dim=2)
    out = torch.nn.functional.scaled_dot_product_attention(query[:, :, None], keys, values, scale=scaling,
                                                           enable_gqa=hq != h)
    return out[:, :, 0]
