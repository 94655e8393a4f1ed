"""transformers glue: ``attn_implementation="neutrain_sage"``.

:func:`register` adds :func:`neutrain_sage_attention_forward` to transformers'
``AttentionInterface`` and :func:`neutrain_sage_mask` to ``AttentionMaskInterface``.
The mask function is required: a name missing from the mask registry gets *no*
mask at all, which would silently ignore padding.

The mask function returns the 2D key-padding mask (or ``None``), like
FlashAttention's; packed sequences are recognized from ``position_ids`` (a new
document starts wherever the position does not increase by one), which the model
passes to the attention function. Everything the kernel does not support goes to
torch SDPA (or a small math path for softcap/sinks), counted and logged once.

On a GPU every supported call then asks :mod:`neutrain.attention.dispatch` whether the
benchmark measured SageAttention faster than cuDNN SDPA for that device and shape
(forward-only when no gradient is being recorded, forward+backward otherwise); where
it did not, the call runs SDPA (cuDNN first), also counted and logged once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from neutrain import compat
from neutrain.attention import dispatch
from neutrain.attention.counters import record_fallback
from neutrain.attention.sage import SUPPORTED_HEAD_DIMS, sage_attention

ATTENTION_NAME = "neutrain_sage"


def neutrain_sage_mask(*args, attention_mask: torch.Tensor | None = None, kv_length: int | None = None, **kwargs):
    """Mask function for ``AttentionMaskInterface``: the bool [B, kv_length] padding mask or ``None``.

    Keyword-only on purpose: transformers calls mask functions by keyword, and the
    other keywords differ between 5.x releases.
    """
    if attention_mask is None:
        return None
    mask = attention_mask.bool()
    if kv_length is not None:
        mask = mask[:, -kv_length:]
    if kv_length is not None and mask.shape[1] == kv_length and bool(mask.all()):
        return None
    return mask


def segments_from_position_ids(position_ids: torch.Tensor | None, batch: int, n: int) -> torch.Tensor | None:
    """Document ids [B, N] of packed rows (positions restart), or ``None`` if no row is packed."""
    if position_ids is None or position_ids.shape[-1] != n:
        return None
    pos = position_ids.expand(batch, -1) if position_ids.shape[0] != batch else position_ids
    starts = torch.zeros_like(pos, dtype=torch.int32)
    starts[:, 1:] = (pos[:, 1:] - pos[:, :-1] != 1).to(torch.int32)
    if not bool(starts.any()):
        return None
    return starts.cumsum(-1, dtype=torch.int32)


def _fallback_mask(q_len, kv_len, causal, padding, segments, sliding_window, device):
    """Bool [B|1, 1, q_len, kv_len] mask (True = attend) for the SDPA fallback, or ``None``."""
    mask = None
    q_pos = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    k_pos = torch.arange(kv_len, device=device)[None, :]
    if causal:
        mask = (k_pos <= q_pos)[None, None]
    if sliding_window:
        window = (q_pos - k_pos < sliding_window)[None, None]
        mask = window if mask is None else mask & window
    if padding is not None:
        pad = padding[:, None, None, :]
        mask = pad if mask is None else mask & pad
    if segments is not None:
        seg = (segments[:, None, -q_len:, None] == segments[:, None, None, :])
        mask = seg if mask is None else mask & seg
    return mask


def _fallback(query, key, value, mask, dropout, scaling, softcap, s_aux):
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    if not softcap and s_aux is None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
        return out.transpose(1, 2).contiguous()
    # Softcap and attention sinks: SDPA has neither, so compute the few such calls in plain math.
    scores = (query @ key.transpose(-1, -2)).float() * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if s_aux is not None:
        sink = s_aux.float().reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = F.dropout(probs.nan_to_num(0.0), p=dropout, training=dropout > 0).to(value.dtype)
    return (probs @ value).transpose(1, 2).contiguous()


def neutrain_sage_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """transformers attention function: [B,H,L,D] in, ``([B, L, Hq, D], None)`` out.

    GQA is not expanded (SageAttention reads the shared K/V head); ``scaling`` is respected.
    """
    q_len, kv_len, head_dim = query.shape[2], key.shape[2], query.shape[3]
    scaling = head_dim ** -0.5 if scaling is None else scaling
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    padding = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
    segments = segments_from_position_ids(kwargs.get("position_ids"), query.shape[0], kv_len)
    softcap, sliding_window, s_aux = kwargs.get("softcap"), kwargs.get("sliding_window"), kwargs.get("s_aux")
    reason = None
    if q_len == 1:
        reason = "decode (q_len == 1)"
    elif dropout and dropout > 0:
        reason = "dropout"
    elif softcap:
        reason = "softcap"
    elif sliding_window:
        reason = "sliding window"
    elif s_aux is not None:
        reason = "attention sinks (s_aux)"
    elif kwargs.get("output_attentions"):
        reason = "output_attentions"
    elif head_dim not in SUPPORTED_HEAD_DIMS:
        reason = f"head_dim={head_dim}"
    elif q_len != kv_len:
        reason = "q_len != kv_len (prefill with a cache)"
    elif attention_mask is not None and padding is None:
        reason = f"{attention_mask.dim()}D attention mask"
    if reason is not None:
        record_fallback(reason)
        if attention_mask is not None and padding is None:
            mask = attention_mask
            if mask.dtype != torch.bool:  # additive float mask
                mask = mask > torch.finfo(mask.dtype).min / 2
        else:
            mask = _fallback_mask(q_len, kv_len, causal, padding, segments, sliding_window, query.device)
        return _fallback(query, key, value, mask, dropout, scaling, softcap, s_aux), None
    # CPU keeps the quantized reference forward (build_model gives CPU runs SDPA anyway); its backward
    # route is NEUTRAIN_SAGE_BACKWARD's (benchmarks/sage_fidelity.py runs the exact one, as a GPU would).
    backward, config, backend = dispatch.cpu_backward(), None, "auto"
    if query.is_cuda:
        training = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        device = torch.cuda.get_device_name(query.device)
        choice = dispatch.choose(device, head_dim, causal, str(query.dtype).removeprefix("torch."), training, q_len)
        if choice.backend != "sage":
            record_fallback(f"dispatch: {choice.reason}")
            if padding is None and segments is None:
                return _sdpa_fast(query, key, value, causal, scaling), None
            mask = _fallback_mask(q_len, kv_len, causal, padding, segments, None, query.device)
            return _fallback(query, key, value, mask, 0.0, scaling, None, None), None
        backward, config, backend = choice.backward, dispatch.kernel_config(device, head_dim), choice.kernel
    out = sage_attention(query, key, value, causal=causal, scale=scaling, segment_ids=segments,
                         key_padding_mask=padding, backward=backward, config=config, backend=backend)
    return out.transpose(1, 2).contiguous(), None


def _sdpa_fast(query, key, value, causal, scaling):
    """SDPA without a mask tensor, cuDNN first (the fastest backend on Hopper), as [B, L, H, D]."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # cuDNN takes no enable_gqa; repeated heads cost one copy of K and V
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    with compat.sdpa_prefer_cudnn():
        out = F.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scaling)
    return out.transpose(1, 2).contiguous()


def register() -> str:
    """Register ``"neutrain_sage"`` with transformers (idempotent) and return the name.

    Example:
        >>> from transformers import AutoModelForCausalLM, LlamaConfig
        >>> name = register()
        >>> cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
        ...                   num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
        >>> model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, neutrain_sage_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, neutrain_sage_mask)
    return ATTENTION_NAME
