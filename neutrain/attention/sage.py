"""Differentiable SageAttention: quantized forward, straight-through backward.

The autograd function quantizes Q/K/V once (:mod:`neutrain.attention.quant`), runs
the forward on the Triton kernel (CUDA, or the CPU interpreter when asked) or on
the pure-PyTorch reference of the same math (CPU), and saves the 1-byte Q/K/V with
their scales, O and the LSE. The backward recomputes S from the saved INT8 Q/K.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from neutrain import compat
from neutrain.attention.counters import count, record_fallback
from neutrain.attention.quant import TILE, natural_lse, quantize_attention_inputs, smoothed_k
from neutrain.attention.reference import sage_reference_backward, sage_reference_forward

SUPPORTED_HEAD_DIMS = (64, 128)


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "triton" if device.type == "cuda" else "reference"
    if backend not in ("triton", "gluon", "reference"):
        raise ValueError(f"backend must be 'auto', 'triton', 'gluon' or 'reference', got {backend!r}")
    return backend


def gluon_runs(qi, segment_q) -> bool:
    """Whether the Gluon Hopper forward takes this call: a CUDA GPU of capability 9.x, a Triton with
    Gluon's Hopper API, and a call it computes (no segments, no Q smoothing); else the Triton kernel."""
    if not qi.q_int.is_cuda or torch.cuda.get_device_capability(qi.q_int.device)[0] != 9:
        return False
    try:
        from neutrain.kernels.sage_attention_gluon import gluon_available, gluon_supports  # lazy: Triton, GPU path only
    except ImportError:  # a Triton without Gluon
        return False
    return gluon_available() and gluon_supports(qi, segment_q)


#: Backward routes: "triton" (the straight-through quantized backward kernels, or the reference on
#: CPU) and torch's exact bf16 SDPA backward kernels fed with the quantized forward's O and LSE.
BACKWARD_ROUTES = ("triton", "cudnn", "flash", "cpu")


class _SageAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, segment_q, segment_k, smooth_q, qk_bits, v_residual, backend,
                backward, config):
        k_group = TILE if config is not None and config.get("k_tile_scale") else 16
        qi = quantize_attention_inputs(q, k, v, scale, smooth_q=smooth_q, qk_bits=qk_bits, v_residual=v_residual,
                                       k_group=k_group)
        if backend == "gluon" and gluon_runs(qi, segment_q):
            # lazy: Triton, GPU path only
            from neutrain.kernels.sage_attention_gluon import sage_attention_forward_gluon

            out, lse = sage_attention_forward_gluon(qi, causal, segment_q, segment_k, out_dtype=q.dtype)
            count("kernel")
            count("kernel_gluon")
        elif backend in ("triton", "gluon"):  # gluon elsewhere: the Triton kernel is its fallback
            from neutrain.kernels.sage_attention import ForwardConfig, sage_attention_forward  # lazy: Triton, GPU path only

            launch = None
            if config is not None:
                launch = ForwardConfig(config["block_m"], config["num_warps"], config["num_stages"],
                                       bool(config.get("pipeline")))
            out, lse = sage_attention_forward(qi, causal, segment_q, segment_k, out_dtype=q.dtype, config=launch)
            count("kernel")
        else:
            out, lse = sage_reference_forward(qi, causal, segment_q, segment_k, out_dtype=q.dtype)
            count("reference")
        ctx.causal, ctx.backend, ctx.backward_route, ctx.scale = causal, backend, backward, scale
        if backward != "triton":
            # Exact route: the bf16 inputs (K smoothed), O and the natural LSE; the 1-byte copies go.
            if any(ctx.needs_input_grad[:3]):
                ctx.save_for_backward(q, smoothed_k(qi, k), v, out, natural_lse(qi, lse))
        else:
            ctx.qi = qi
            ctx.save_for_backward(out, lse, segment_q, segment_k)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.backward_route != "triton":
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = exact_backward(ctx.backward_route, grad_out, q, k, v, out, lse, ctx.causal, ctx.scale)
            count(f"exact_backward:{ctx.backward_route}")
            return dq, dk, dv, *([None] * 10)
        out, lse, segment_q, segment_k = ctx.saved_tensors
        if ctx.backend in ("triton", "gluon"):
            from neutrain.kernels.sage_attention_backward import sage_attention_backward  # lazy: Triton, GPU path only

            dq, dk, dv = sage_attention_backward(ctx.qi, out, lse, grad_out, ctx.causal, segment_q, segment_k)
            count("kernel_backward")
        else:
            dq, dk, dv = sage_reference_backward(ctx.qi, out, lse, grad_out, ctx.causal, segment_q, segment_k)
            count("reference_backward")
        dtype = out.dtype
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), *([None] * 10)


#: Routes whose torch kernels take fewer K/V heads than Q heads as they are; the others get
#: K and V repeated per query head, and their dK/dV summed back over each group.
NATIVE_GQA_ROUTES: frozenset[str] = frozenset()  # benchmarks/attention/attention.py reports which could join


def exact_backward(route, grad_out, q, k, v, out, lse, causal, scale):
    """dq, dk, dv of exact attention at the bf16 inputs, with the forward's ``out`` and natural ``lse``
    (straight-through: the quantizers' Jacobians are taken as identity), via :func:`compat.sdpa_backward`."""
    groups = q.shape[1] // k.shape[1]
    expand = groups > 1 and route not in NATIVE_GQA_ROUTES
    ke, ve = (k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)) if expand else (k, v)
    dq, dk, dv = compat.sdpa_backward(route, grad_out, q, ke, ve, out, lse, causal, scale)
    if expand:
        b, hk, n, d = k.shape
        dk, dv = dk.view(b, hk, groups, n, d).sum(2), dv.view(b, hk, groups, n, d).sum(2)
    return dq, dk, dv


def sdpa_attention(q, k, v, causal=False, scale=None, segment_q=None, segment_k=None):
    """torch SDPA on [B, H, N, D] with GQA and optional segment ids: the fallback path."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    mask = None
    if segment_q is not None:
        n_q, n_k = q.shape[2], k.shape[2]
        mask = segment_q[:, None, :, None] == segment_k[:, None, None, :]
        if causal:
            mask = mask & torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
        causal = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def sage_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    *,
    segment_ids: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    smooth_q: bool = False,
    qk_bits: int = 8,
    v_residual: bool = True,
    backend: str = "auto",
    backward: str = "triton",
    config: dict | None = None,
) -> torch.Tensor:
    """SageAttention2 (INT8 QK, FP8 PV) with gradients to q, k and v.

    Args:
        q: [B, Hq, N, D] queries (bf16/fp16/fp32); D in (64, 128) for the quantized path.
        k, v: [B, Hk, N, D] with Hq % Hk == 0 (GQA).
        causal: mask keys after the query.
        scale: softmax scale, default D**-0.5.
        segment_ids: [B, N] document ids of packed sequences; tokens attend only
            within their document.
        key_padding_mask: [B, N] bool, True for real tokens; padding keys are ignored.
        smooth_q: subtract Q's per-16-token mean before quantizing and add the
            ``dS = q_mean . K^T`` correction.
        qk_bits: 8, or 4 for simulated INT4 Q/K (Hopper has no INT4 tensor cores).
        v_residual: also multiply P by V's FP8 rounding residual (a second FP8 wgmma
            per tile); False is plain SageAttention2 (~3.6% relative L1 on random
            data instead of ~2.5%, and faster).
        backend: "auto" (Triton on CUDA, the pure-PyTorch quantized reference on
            CPU), "triton" (also runs on the CPU interpreter), "gluon" (the warp-specialized
            Hopper forward of :mod:`neutrain.kernels.sage_attention_gluon` on capability 9.x
            GPUs for calls without segments or Q smoothing, else the Triton kernel; the
            backward is the same as "triton"'s) or "reference".
        backward: "triton" (the quantized straight-through kernels: S recomputed from
            the INT8 Q/K, dV from the forward's FP8 P), or an exact bf16 torch kernel fed
            the forward's O and LSE: "cudnn", "flash" (CUDA) or "cpu". The exact routes
            need no segments (they fall back to "triton" when segment ids or padding are set).
        config: forward kernel settings (``block_m``, ``num_warps``, ``num_stages``,
            ``pipeline``, ``k_tile_scale``), as the dispatch table stores them per device.

    Returns:
        [B, Hq, N, D] in q's dtype. Rows that may attend no key are 0.

    Example:
        >>> q, k, v = (torch.randn(1, 4, 64, 64, requires_grad=True) for _ in range(3))
        >>> out = sage_attention(q, k, v, causal=True)
        >>> out.sum().backward()
        >>> q.grad.shape
        torch.Size([1, 4, 64, 64])
    """
    if q.dim() != 4 or k.shape != v.shape or q.shape[1] % k.shape[1] or q.shape[0] != k.shape[0]:
        raise ValueError(f"expected [B,H,N,D] with GQA-compatible heads, got {tuple(q.shape)}, {tuple(k.shape)}")
    d = q.shape[-1]
    scale = d ** -0.5 if scale is None else float(scale)
    segment_q = segment_k = None
    if segment_ids is not None or key_padding_mask is not None:
        b, n = q.shape[0], q.shape[2]
        seg = segment_ids if segment_ids is not None else torch.zeros(b, n, dtype=torch.int32, device=q.device)
        segment_q = seg.to(torch.int32)
        segment_k = segment_q if key_padding_mask is None else torch.where(key_padding_mask.bool(), segment_q, -1)
        segment_q, segment_k = segment_q.contiguous(), segment_k.to(torch.int32).contiguous()
    if d not in SUPPORTED_HEAD_DIMS or q.shape[2] != k.shape[2]:
        record_fallback(f"head_dim={d}" if d not in SUPPORTED_HEAD_DIMS else "q_len != kv_len")
        return sdpa_attention(q, k, v, causal, scale, segment_q, segment_k)
    backend = _resolve_backend(backend, q.device)
    if backward not in BACKWARD_ROUTES:
        raise ValueError(f"backward must be one of {BACKWARD_ROUTES}, got {backward!r}")
    if segment_q is not None:
        backward = "triton"  # torch's exact kernels take no document masks
    return _SageAttentionFunction.apply(q, k, v, causal, scale, segment_q, segment_k, smooth_q, qk_bits, v_residual,
                                        backend, backward, config)
