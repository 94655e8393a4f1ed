"""Every place neutrain touches torch where releases differ or an API is private, one adapter each.

neutrain supports torch 2.6 and later (``pyproject.toml``); the GPU image runs 2.11, CI the newest.
Each adapter's docstring says which releases need it and when it can go. The other torch adapters:
:mod:`~neutrain.compat.autograd` ("is a backward running?") and :mod:`~neutrain.compat.cpu_features`
(native bf16 on a CPU).

Example:
    >>> from neutrain.compat.torch_api import SDPA_BACKWARD_ROUTES
    >>> SDPA_BACKWARD_ROUTES
    ('cudnn', 'flash', 'cpu')
"""

from __future__ import annotations

# --- Private SDPA backward ops (attention) ---
# SageAttention's "exact backward" route hands its quantized forward's O and log-sum-exp to
# the bf16 backward kernels that torch ships. Those ops are private (aten::_scaled_dot_product_*),
# and their argument lists and LSE layouts drift between releases: this adapter is the one
# place that knows them. Layouts (torch 2.11-2.13): flash LSE [B, H, N] fp32; cuDNN LSE
# [B, H, N, 1] fp32 (the non-ragged layout its forward allocates); CPU flash LSE [B, N, H]
# viewed as [B, H, N]. All are natural-log LSEs of the *scaled* scores.
# Private in every release: stays, and its layouts are checked again with each torch release.

#: Routes :func:`sdpa_backward` knows, fastest first on Hopper (measured: benchmarks/attention/attention.py).
SDPA_BACKWARD_ROUTES = ("cudnn", "flash", "cpu")
_RNG_STATE: dict = {}


def _forward_rng_state(route: str, device, dtype):
    """The (philox seed, offset) tensors a dropout-free forward of ``route`` returns, from one tiny call
    per (route, device, dtype): the backward ops take them as they come (possibly empty/undefined)."""
    import torch

    key = (route, str(device), dtype)
    if key not in _RNG_STATE:
        x = torch.zeros(1, 1, 16, 64, device=device, dtype=dtype)
        if route == "cudnn":
            res = torch.ops.aten._scaled_dot_product_cudnn_attention(x, x, x, None, True, 0.0, False, False, scale=1.0)
        else:
            res = torch.ops.aten._scaled_dot_product_flash_attention(x, x, x, 0.0, False, False, scale=1.0)
        _RNG_STATE[key] = (res[6], res[7])
    return _RNG_STATE[key]


def sdpa_backward(route: str, grad_out, q, k, v, out, lse, causal: bool, scale: float):
    """Exact bf16/fp16 attention backward through torch's private SDPA backward ops.

    Args:
        route: ``"cudnn"``, ``"flash"`` (CUDA) or ``"cpu"`` (torch's CPU flash kernel).
        grad_out, q, out: [B, H, N, D]; k, v: [B, H, N, D] (heads already expanded for GQA).
        lse: [B, H, N] fp32, natural-log log-sum-exp of ``scale * q.k`` per query row.
        causal: upper-left causal mask (q_len == kv_len).
        scale: the softmax scale.

    Returns:
        ``(dq, dk, dv)`` shaped like ``q, k, v``.

    Example:
        >>> import torch
        >>> q = k = v = torch.randn(1, 2, 8, 16)
        >>> out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=0.25)
        >>> dq, dk, dv = sdpa_backward("cpu", torch.ones_like(out), q, k, v, out, lse.transpose(1, 2), False, 0.25)
    """
    import torch

    aten = torch.ops.aten
    b, h, n, _ = q.shape
    if grad_out.stride() != out.stride():  # cuDNN builds its graph for one layout of O and dO
        grad_out = torch.empty_like(out).copy_(grad_out)
    lse = lse.float()
    # Dense (not varlen) calls: cumulative sequence lengths and the bias are undefined tensors
    # (None), as autograd passes them; the dropout RNG state is whatever the forward returns.
    if route == "cudnn":
        seed, offset = _forward_rng_state("cudnn", q.device, q.dtype)
        return aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k, v, out, lse.reshape(b, h, n, 1).contiguous(), seed, offset, None, None, None,
            n, k.shape[2], 0.0, causal, scale=scale)
    if route == "flash":
        seed, offset = _forward_rng_state("flash", q.device, q.dtype)
        return aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse.contiguous(), None, None, n, k.shape[2], 0.0, causal, seed, offset,
            scale=scale)
    if route == "cpu":
        # The CPU kernel keeps its LSE as [B, N, H] memory viewed as [B, H, N].
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse.transpose(1, 2).contiguous().transpose(1, 2), 0.0, causal, scale=scale)
    raise ValueError(f"unknown SDPA backward route {route!r}; expected one of {SDPA_BACKWARD_ROUTES}")


# --- Autograd internals (nn.stack_views) ---


def saved_tensor_hooks_active() -> bool:
    """True while outer ``saved_tensors_hooks`` (e.g. activation checkpointing's) are installed.

    Reads torch's private hook stack (present since torch 2.1, as in 2.11 and 2.13); if that
    ever changes, answers True: callers then keep what they save (correct, more memory).

    Private in every release: stays until torch answers this publicly.
    """
    import torch

    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    except (AttributeError, TypeError, RuntimeError):
        return True


