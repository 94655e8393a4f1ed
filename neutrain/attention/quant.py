"""Quantizers shared by the SageAttention kernel and its pure-PyTorch reference.

The Triton kernel consumes exactly the tensors produced here, so the kernel and
:mod:`neutrain.attention.reference` see bit-identical quantized inputs; only the
attention arithmetic differs between them.

Scheme (SageAttention2, see ``docs/attention.md`` §1.2, §5.1):

* K is smoothed by subtracting its per-head mean over tokens. Exact: ``q . k_mean``
  is constant along a score row and softmax ignores row constants.
* Q and K go to INT8 (or simulated INT4, values in [-7, 7] stored in int8) per
  group of ``group`` consecutive tokens, symmetric, round-to-nearest-even. The
  scale is stored per token (expanded), so the kernel applies it with one multiply
  per score; ``softmax_scale * log2(e)`` is folded into the Q scale so that the
  kernel's softmax runs in the exp2 domain.
* Optional Q smoothing: subtract each group's mean before quantizing; the kernel
  adds the correction ``dS = q_mean . K^T`` in higher precision.
* V goes to FP8 E4M3 per channel (scale ``amax / 448``), stored transposed as
  ``[B, H, D, N]`` because Hopper's 8-bit ``wgmma`` wants the reduction (token)
  dimension contiguous. By default a second FP8 tensor holds the rounding residual
  (times :data:`V_RESIDUAL_GAIN`): FP8 P and FP8 V each carry ~2.5% relative
  rounding error, which on zero-mean random V adds up to ~3.6% relative L1 in O;
  the residual removes V's share for one more FP8 ``wgmma`` per tile.

On CUDA (without Q smoothing) the same quantization runs as Triton kernels
(``neutrain.kernels.sage_quant``: ``kv_stats``, then ``quantize_qk_int`` / ``quantize_v_fp8``),
close to two reads of K and V and one of Q; ``NEUTRAIN_SAGE_FUSED_QUANT=0`` selects these
torch ops instead.

All token dimensions are padded to a multiple of :data:`TILE` with zeros so the
kernel's inner loops never need bounds checks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from neutrain.config.knobs import knob

# The format shared with the kernels lives below both layers; re-exported here for the reference and callers.
from neutrain.kernels.sage_format import (  # noqa: F401
    _MIN_AMAX,
    FP8_MAX,
    LN2,
    LOG2_FP8_MAX,
    LOG2E,
    TILE,
    V_RESIDUAL_GAIN,
    QuantizedAttentionInputs,
    fp8_channel_scale,
    round_up,
)


def quantize_int_per_group(x: torch.Tensor, group: int, bits: int, n_pad: int, fold: float = 1.0):
    """Symmetric per-token-group integer quantization of ``x`` [B, H, N, D].

    Args:
        x: input, any float dtype.
        group: tokens sharing one scale; must divide :data:`TILE`.
        bits: 8 (INT8) or 4 (INT4 simulated: values in [-7, 7] stored as int8).
        n_pad: padded token count (multiple of ``group``).
        fold: factor folded into the returned scale (``softmax_scale*log2e`` for Q).

    Returns:
        ``(x_int [B,H,n_pad,D] int8, scale [B,H,n_pad] fp32)`` with
        ``x ~= x_int * scale / fold`` on the first N tokens.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if TILE % group:
        raise ValueError(f"group {group} must divide {TILE}")
    qmax = 127.0 if bits == 8 else 7.0
    b, h, n, d = x.shape
    xf = F.pad(x.float(), (0, 0, 0, n_pad - n))
    grouped = xf.view(b, h, n_pad // group, group, d)
    scale = grouped.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(_MIN_AMAX) / qmax
    x_int = torch.round(grouped / scale).clamp_(-qmax, qmax).to(torch.int8)
    scale_tok = (scale * fold).expand(b, h, n_pad // group, group, 1).reshape(b, h, n_pad)
    return x_int.view(b, h, n_pad, d), scale_tok.contiguous()


def quantize_v_fp8_transposed(v: torch.Tensor, n_pad: int, residual: bool = True):
    """Per-channel FP8 E4M3 V, transposed to [B, H, D, n_pad].

    Returns:
        ``(v_fp8_t, v_residual_t or None, scale [B,H,D])`` with
        ``V ~= scale * (v_fp8 + v_residual / V_RESIDUAL_GAIN)``.
    """
    vf = v.float()
    scale = fp8_channel_scale(v)
    scaled = F.pad(vf / scale[:, :, None, :], (0, 0, 0, n_pad - v.shape[2])).transpose(2, 3).contiguous()
    v_fp8_t = scaled.to(torch.float8_e4m3fn)
    v_residual_t = None
    if residual:
        v_residual_t = ((scaled - v_fp8_t.float()) * V_RESIDUAL_GAIN).to(torch.float8_e4m3fn)
    return v_fp8_t, v_residual_t, scale.contiguous()


def quantize_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    *,
    smooth_q: bool = False,
    qk_bits: int = 8,
    q_group: int = 16,
    k_group: int = 16,
    v_residual: bool = True,
) -> QuantizedAttentionInputs:
    """Smooth and quantize Q, K, V ([B, H, N, D]; K/V may have fewer heads) for SageAttention.

    Example:
        >>> q = k = v = torch.randn(1, 2, 40, 64)
        >>> qi = quantize_attention_inputs(q, k, v, 64 ** -0.5)
        >>> qi.q_int.shape, qi.v_fp8_t.shape
        (torch.Size([1, 2, 128, 64]), torch.Size([1, 2, 64, 128]))
    """
    n = q.shape[2]
    n_pad = round_up(n, TILE)
    fold = softmax_scale * LOG2E
    if q.is_cuda and not smooth_q and knob("NEUTRAIN_SAGE_FUSED_QUANT"):
        return _quantize_cuda(q, k, v, softmax_scale, qk_bits, q_group, k_group, v_residual, n_pad)
    with torch.no_grad():
        # Smooth K with a detached mean: exact for the softmax, so no gradient flows through it.
        k_mean = k.float().mean(dim=2, keepdim=True)

        k_int, k_scale = quantize_int_per_group(k.float() - k_mean, k_group, qk_bits, n_pad)
        q_mean_tok = None
        qf = q.float()
        if smooth_q:
            b, h, _, d = q.shape
            padded = F.pad(qf, (0, 0, 0, n_pad - n)).view(b, h, n_pad // q_group, q_group, d)
            # Mean over the real tokens of each group (padding rows must not drag it to zero).
            valid = (torch.arange(n_pad, device=q.device) < n).view(1, 1, n_pad // q_group, q_group, 1)
            count = valid.sum(dim=3, keepdim=True).clamp_min(1)
            mean = (padded * valid).sum(dim=3, keepdim=True) / count
            q_mean_tok = (mean * valid).expand_as(padded).reshape(b, h, n_pad, d)
            qf = (padded.reshape(b, h, n_pad, d) - q_mean_tok)[:, :, :n]
            q_mean_tok = (q_mean_tok * fold).to(torch.bfloat16).contiguous()
        q_int, q_scale = quantize_int_per_group(qf, q_group, qk_bits, n_pad, fold)
        v_fp8_t, v_residual_t, v_scale = quantize_v_fp8_transposed(v, n_pad, v_residual)
    return QuantizedAttentionInputs(
        q_int=q_int.contiguous(),
        q_scale=q_scale,
        q_mean=q_mean_tok,
        k_int=k_int.contiguous(),
        k_scale=k_scale,
        k_mean=k_mean,
        v_fp8_t=v_fp8_t,
        v_residual_t=v_residual_t,
        v_scale=v_scale,
        seq_len=n,
        softmax_scale=float(softmax_scale),
        k_group=k_group,
    )


def _quantize_cuda(q, k, v, softmax_scale, qk_bits, q_group, k_group, v_residual, n_pad, separate_passes=None):
    """The same quantization through Triton kernels: K's mean and V's scale in one stats pass
    over K and V, then one pass over each of Q, K and V with a tile of tokens per program.

    ``separate_passes`` (default: ``NEUTRAIN_SAGE_QUANT_SEPARATE_PASSES``) keeps the older
    launches for timing: K's mean and V's amax in torch, one group of tokens per Q/K program.
    """
    from neutrain.kernels.sage_quant import kv_stats, quantize_qk_int, quantize_v_fp8  # lazy: Triton, CUDA only

    if separate_passes is None:
        separate_passes = knob("NEUTRAIN_SAGE_QUANT_SEPARATE_PASSES")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    with torch.no_grad():
        if separate_passes:
            k_mean, v_scale = k.mean(dim=2, keepdim=True, dtype=torch.float32), None
        else:
            k_mean, v_scale = kv_stats(k, v)
        q_int, q_scale = quantize_qk_int(q, q_group, qk_bits, n_pad, softmax_scale * LOG2E,
                                         block_n=q_group if separate_passes else TILE)
        k_int, k_scale = quantize_qk_int(k, k_group, qk_bits, n_pad, mean=k_mean,
                                         block_n=k_group if separate_passes else TILE)
        v_fp8_t, v_residual_t, v_scale = quantize_v_fp8(v, n_pad, v_residual, scale=v_scale)
    return QuantizedAttentionInputs(
        q_int=q_int, q_scale=q_scale, q_mean=None, k_int=k_int, k_scale=k_scale, k_mean=k_mean,
        v_fp8_t=v_fp8_t, v_residual_t=v_residual_t, v_scale=v_scale, seq_len=q.shape[2],
        softmax_scale=float(softmax_scale), k_group=k_group)


def natural_lse(qi: QuantizedAttentionInputs, lse2: torch.Tensor) -> torch.Tensor:
    """[B, Hq, N] natural-log LSE of the *smoothed* scaled scores ``scale * q.(k - k_mean)``.

    The kernel's ``lse2`` is in the log2 domain (``softmax_scale * log2(e)`` is folded into
    Q); torch's SDPA backward kernels want natural logs. Pair it with the smoothed K
    (:func:`smoothed_k`), not K: softmax ignores the row constant ``q.k_mean``, and with the
    smoothed K the backward's dQ = dS.K_smooth carries no ``rowsum(dS) * k_mean`` term, which
    the small mismatch between the quantized forward's O/LSE and bf16 scores would blow up
    wherever keys share a large offset.

    Example:
        >>> q = k = v = torch.randn(1, 1, 8, 64)
        >>> qi = quantize_attention_inputs(q, k, v, 0.125)
        >>> natural_lse(qi, torch.zeros(1, 1, 128)).shape
        torch.Size([1, 1, 8])
    """
    return lse2[..., : qi.seq_len] * LN2


def smoothed_k(qi: QuantizedAttentionInputs, k: torch.Tensor) -> torch.Tensor:
    """``k - k_mean`` in k's dtype: the keys whose scores :func:`natural_lse` describes."""
    return (k.float() - qi.k_mean).to(k.dtype)
