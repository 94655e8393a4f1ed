"""Pure-PyTorch references for SageAttention: the exact same quantized math, and exact fp32 attention.

:func:`sage_reference_forward` and :func:`sage_reference_backward` reproduce the
Triton kernel's arithmetic step by step (integer QK dot, per-token scales,
exp2-domain online softmax over KV tiles of :data:`~neutrain.attention.quant.TILE`
keys, each tile's P quantized to FP8 E4M3 against that tile's own row max with the
fixed scale 448, a fresh PV accumulator per tile added into fp32, the same bf16
casts in the backward). They are the CPU path of
:func:`neutrain.attention.sage_attention` and the oracle of the kernel tests.

:func:`exact_attention` is plain softmax attention in fp32 (or fp64), the ground
truth for accuracy metrics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from neutrain.attention.quant import FP8_MAX, LN2, LOG2_FP8_MAX, TILE, V_RESIDUAL_GAIN, QuantizedAttentionInputs

_NEG_INF = float("-inf")


def allowed_mask(
    n_q: int,
    n_k: int,
    causal: bool,
    seq_len: int,
    segment_q: torch.Tensor | None = None,
    segment_k: torch.Tensor | None = None,
    device=None,
) -> torch.Tensor:
    """Boolean [B|1, 1, n_q, n_k] mask, True where query i may attend key j.

    Keys at or beyond ``seq_len`` (padding to the tile) are never allowed; ``causal``
    allows j <= i; segment ids (document ids, -1 for padding keys) must match.
    """
    qi = torch.arange(n_q, device=device)[:, None]
    kj = torch.arange(n_k, device=device)[None, :]
    allowed = (kj < seq_len).expand(n_q, n_k)
    if causal:
        allowed = allowed & (kj <= qi)
    allowed = allowed[None, None]
    if segment_q is not None:
        sq = F.pad(segment_q, (0, n_q - segment_q.shape[1]), value=-1)
        sk = F.pad(segment_k, (0, n_k - segment_k.shape[1]), value=-2)
        allowed = allowed & (sq[:, None, :, None] == sk[:, None, None, :])
    return allowed


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _scores(qi: QuantizedAttentionInputs, k_lo: int, k_hi: int) -> torch.Tensor:
    """Scaled log2-domain scores of all queries against keys [k_lo, k_hi), as the kernel forms them."""
    groups = qi.q_int.shape[1] // qi.k_int.shape[1]
    k_int = _expand_kv(qi.k_int[:, :, k_lo:k_hi], groups).float()
    k_scale = _expand_kv(qi.k_scale[:, :, k_lo:k_hi], groups)
    # Integer dot products are exact in fp32 (|sum| <= 127*127*D < 2**24).
    qk = qi.q_int.float() @ k_int.transpose(-1, -2)
    s = qk * k_scale[..., None, :] * qi.q_scale[..., None]  # the kernel's rounding order
    if qi.q_mean is not None:
        s = s + (qi.q_mean.float() @ k_int.transpose(-1, -2)) * k_scale[..., None, :]
    return s


def sage_reference_forward(
    qi: QuantizedAttentionInputs,
    causal: bool,
    segment_q: torch.Tensor | None = None,
    segment_k: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
):
    """Quantized SageAttention forward, tile by tile like the kernel.

    Returns:
        ``(out [B, Hq, N, D] in out_dtype, lse [B, Hq, Np] fp32)``; ``lse`` is the
        log2-domain log-sum-exp of the scaled scores (``+inf`` for rows that attend
        nothing, whose output is 0).
    """
    b, h, n_pad, d = qi.q_int.shape
    groups = h // qi.k_int.shape[1]
    dev = qi.q_int.device
    m_i = torch.full((b, h, n_pad), _NEG_INF, device=dev)
    l_i = torch.zeros((b, h, n_pad), device=dev)
    acc = torch.zeros((b, h, n_pad, d), device=dev)
    allowed = allowed_mask(n_pad, n_pad, causal, qi.seq_len, segment_q, segment_k, dev)
    v_t = _expand_kv(qi.v_fp8_t, groups)
    v_res_t = _expand_kv(qi.v_residual_t, groups) if qi.v_residual_t is not None else None
    for lo in range(0, n_pad, TILE):
        hi = lo + TILE
        s = _scores(qi, lo, hi).masked_fill(~allowed[..., lo:hi], _NEG_INF)
        m_tile = s.amax(dim=-1)
        m_new = torch.maximum(m_i, m_tile)
        m_tile_safe = torch.where(m_tile == _NEG_INF, 0.0, m_tile)
        m_new_safe = torch.where(m_new == _NEG_INF, 0.0, m_new)
        # p448 = 448 * exp2(s - m_tile): each tile's P uses the full FP8 range.
        p448 = torch.exp2(s - (m_tile_safe - LOG2_FP8_MAX)[..., None])
        alpha = torch.exp2(m_i - m_new_safe)
        beta = torch.exp2(m_tile - m_new_safe)
        l_i = l_i * alpha + p448.sum(-1) * (beta * (1.0 / FP8_MAX))
        p_fp8 = p448.to(torch.float8_e4m3fn).float()
        pv = p_fp8 @ v_t[..., lo:hi].float().transpose(-1, -2)  # fresh accumulator per tile
        if v_res_t is not None:
            pv = pv + (p_fp8 @ v_res_t[..., lo:hi].float().transpose(-1, -2)) * (1.0 / V_RESIDUAL_GAIN)
        acc = acc * alpha[..., None] + pv * (beta * (1.0 / FP8_MAX))[..., None]
        m_i = m_new
    empty = l_i == 0
    l_safe = torch.where(empty, 1.0, l_i)
    v_scale = _expand_kv(qi.v_scale, groups)
    out = acc / l_safe[..., None] * v_scale[:, :, None, :]
    lse = torch.where(empty, float("inf"), m_i + torch.log2(l_safe))
    return out[:, :, : qi.seq_len].to(out_dtype), lse


def sage_reference_backward(
    qi: QuantizedAttentionInputs,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    causal: bool,
    segment_q: torch.Tensor | None = None,
    segment_k: torch.Tensor | None = None,
):
    """Straight-through backward of :func:`sage_reference_forward`, the kernel's math.

    S is recomputed from the same quantized Q and K; dV uses the forward's FP8 P
    (re-quantized against each tile's row max exactly as the forward did); dP is
    ``dO . V_hat^T`` with bf16 operands; Delta = rowsum(dO * O) from the stored O;
    dS = P * (dP - Delta) with the unquantized P.

    Returns:
        ``(dq [B,Hq,N,D], dk [B,Hk,N,D], dv [B,Hk,N,D])`` in fp32.
    """
    b, h, n_pad, d = qi.q_int.shape
    hk = qi.k_int.shape[1]
    groups = h // hk
    n = qi.seq_len
    dev = qi.q_int.device
    s = _scores(qi, 0, n_pad)
    allowed = allowed_mask(n_pad, n_pad, causal, n, segment_q, segment_k, dev)
    s = s.masked_fill(~allowed, _NEG_INF)
    p = torch.exp2(s - lse[..., None])
    # Forward-consistent P_hat: FP8 against each KV tile's row max, then renormalized.
    tiles = s.view(b, h, n_pad, n_pad // TILE, TILE)
    m_tile = tiles.amax(dim=-1, keepdim=True)
    m_tile_safe = torch.where(m_tile == _NEG_INF, 0.0, m_tile)
    p_fp8 = torch.exp2(tiles - (m_tile_safe - LOG2_FP8_MAX)).to(torch.float8_e4m3fn).float()
    renorm = torch.exp2(m_tile_safe - lse[..., None, None]) * (1.0 / FP8_MAX)
    p_hat = (p_fp8 * renorm).view(b, h, n_pad, n_pad).to(torch.bfloat16).float()

    do = F.pad(grad_out.float(), (0, 0, 0, n_pad - n))
    do_bf = do.to(torch.bfloat16).float()
    delta = F.pad((grad_out.float() * out.float()).sum(-1), (0, n_pad - n))
    v_scale = _expand_kv(qi.v_scale, groups)
    do_scaled = (do * v_scale[:, :, None, :]).to(torch.bfloat16).float()
    v_t = qi.v_fp8_t.float()
    if qi.v_residual_t is not None:
        v_t = v_t + qi.v_residual_t.float() * (1.0 / V_RESIDUAL_GAIN)
    v_t = _expand_kv(v_t.to(torch.bfloat16).float(), groups)
    dp = do_scaled @ v_t
    ds = (p * (dp - delta[..., None])).to(torch.bfloat16).float()

    k_hat = _expand_kv((qi.k_int.float() * qi.k_scale[..., None]).to(torch.bfloat16).float(), groups)
    q_hat = qi.q_int.float() * qi.q_scale[..., None]
    if qi.q_mean is not None:
        q_hat = q_hat + qi.q_mean.float()
    q_hat = q_hat.to(torch.bfloat16).float()
    dq = (ds @ k_hat) * qi.softmax_scale
    dk = (ds.transpose(-1, -2) @ q_hat) * LN2
    dv = p_hat.transpose(-1, -2) @ do_bf

    def fold_groups(x):
        return x.view(b, hk, groups, n_pad, d).sum(2) if groups > 1 else x

    return dq[:, :, :n], fold_groups(dk)[:, :, :n], fold_groups(dv)[:, :, :n]


def exact_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    segment_q: torch.Tensor | None = None,
    segment_k: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Softmax attention computed in ``dtype`` (fp32 default), differentiable; GQA allowed.

    Rows that attend nothing give 0, like the kernel.

    Example:
        >>> q = k = v = torch.randn(1, 2, 8, 64)
        >>> exact_attention(q, k, v, causal=True).shape
        torch.Size([1, 2, 8, 64])
    """
    groups = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qf, kf, vf = q.to(dtype), _expand_kv(k.to(dtype), groups), _expand_kv(v.to(dtype), groups)
    s = (qf @ kf.transpose(-1, -2)) * scale
    n_q, n_k = q.shape[2], k.shape[2]
    allowed = allowed_mask(n_q, n_k, causal, n_k, segment_q, segment_k, q.device)
    s = s.masked_fill(~allowed, _NEG_INF)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ vf


def accuracy_metrics(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """CosSim, relative L1/L2, RMSE and max-abs error of ``out`` against ``ref`` (flattened, fp64)."""
    o, r = out.detach().double().flatten(), ref.detach().double().flatten()
    diff = o - r
    return {
        "cos": float(F.cosine_similarity(o, r, dim=0)),
        "rel_l1": float(diff.abs().sum() / r.abs().sum().clamp_min(1e-30)),
        "rel_l2": float(diff.norm() / r.norm().clamp_min(1e-30)),
        "rmse": float(diff.pow(2).mean().sqrt()),
        "max_abs": float(diff.abs().max()),
        "finite": bool(torch.isfinite(o).all()),
    }


#: Input families of the accuracy suite: plain Gaussian and three outlier cases.
INPUT_KINDS = ("random", "k_offset", "sink", "heavy_q")


def make_attention_inputs(
    b: int,
    hq: int,
    hk: int,
    n: int,
    d: int,
    kind: str = "random",
    dtype: torch.dtype = torch.bfloat16,
    device="cpu",
    generator: torch.Generator | None = None,
):
    """Fresh random q [b,hq,n,d], k, v [b,hk,n,d] of one :data:`INPUT_KINDS` family.

    ``k_offset``: every key shifted by a large per-channel vector (what smooth-K removes);
    ``sink``: queries share a direction that key 0 aligns with, so token 0 draws most
    of the attention (the FP8-P underflow case); ``heavy_q``: heavy-tailed queries.
    """
    def randn(*shape):
        return torch.randn(*shape, device=device, generator=generator)

    q, k, v = randn(b, hq, n, d), randn(b, hk, n, d), randn(b, hk, n, d)
    if kind == "k_offset":
        k = k + 8.0 * randn(1, hk, 1, d)
    elif kind == "sink":
        u = randn(d)
        q = q + 0.5 * u
        k[:, :, 0] = 2.0 * u
    elif kind == "heavy_q":
        q = q / torch.rand(b, hq, n, 1, device=device, generator=generator).clamp_min(0.1)
    elif kind != "random":
        raise ValueError(f"unknown input kind {kind!r}; expected one of {INPUT_KINDS}")
    return q.to(dtype), k.to(dtype), v.to(dtype)
