"""transformers glue: ``attn_implementation="neutrain_sage"``.

:func:`register` adds :func:`neutrain_sage_attention_forward` to transformers'
``AttentionInterface`` and :func:`neutrain_sage_mask` to ``AttentionMaskInterface``.
The mask function is required: a name missing from the mask registry gets *no*
mask at all, which would silently ignore padding.

The mask function returns the 2D key-padding mask (or ``None``), like
FlashAttention's; packed sequences are recognized from ``position_ids`` (a new
document starts wherever the position does not increase by one), which the model
passes to the attention function. Everything the kernel does not support goes to
torch SDPA (or a small math path for softcap/sinks), counted and logged once; packed causal
rows among those calls run one document at a time instead (:func:`exact_fallback`), as
``neutrain_sdpa`` runs them: the same values, without the block-diagonal mask's cost.

On a GPU every supported call then asks :mod:`neutrain.attention.dispatch` whether the
benchmark measured SageAttention faster than cuDNN SDPA for that device and shape
(forward-only when no gradient is being recorded, forward+backward otherwise); where
it did not, the call is transformers' own ``sdpa`` attention, the very function a model built
with ``attn_implementation="sdpa"`` calls (also counted and logged once), so a recipe asking for
``neutrain_sage`` never trains slower than one asking for SDPA where the table picks SDPA.

Whether a row is packed is read on the host (a device synchronisation) once per ``position_ids``
tensor, not once per layer: the decoder passes the same tensor to every layer, and activation
checkpointing's recompute passes it again (:func:`packed_segments`). Inside
:func:`neutrain.compat.masks.contiguous_positions` (``causal_lm_loss`` calling the decoder without
positions) nothing is read at all.

Every Sage call runs plain SageAttention2's PV (one FP8 product per tile): on an H200 it passed the end-to-end
fine-tuning gate on both backward routes, where the form with a second product for V's rounding residual failed
it (benchmarks/attention/NOTES.md). ``NEUTRAIN_SAGE_V_RESIDUAL=1`` brings the residual back.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from neutrain import compat
from neutrain.compat.masks import positions_are_contiguous
from neutrain.config.knobs import knob
from neutrain.attention import dispatch
from neutrain.attention.counters import record_fallback
from neutrain.attention.per_document import packed_causal_attention
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


# (weak reference to position_ids, its version counter, (batch, n), the segments found): the last answer.
# One module-level entry, not thread-local: the recompute of activation checkpointing runs on the
# autograd engine's thread and must find the forward's answer.
_LAST_PACKING: tuple | None = None


def packed_segments(position_ids: torch.Tensor | None, batch: int, n: int) -> torch.Tensor | None:
    """:func:`segments_from_position_ids`, read once per ``position_ids`` tensor and contents.

    The answer is kept for the tensor it was read from (a weak reference and its version counter, so an
    in-place change or a new tensor reads again); inside ``contiguous_positions()`` it is ``None`` unread.

    Example:
        >>> pos = torch.tensor([[0, 1, 2, 0, 1]])
        >>> packed_segments(pos, 1, 5).tolist()
        [[0, 0, 0, 1, 1]]
        >>> packed_segments(pos, 1, 5) is packed_segments(pos, 1, 5)  # read once
        True
    """
    global _LAST_PACKING
    if position_ids is None or position_ids.shape[-1] != n:
        return None
    if position_ids.is_inference():  # no version counter to key on: generation, not training
        return segments_from_position_ids(position_ids, batch, n)
    key = (position_ids._version, (batch, n))
    last = _LAST_PACKING
    if last is not None and last[0]() is position_ids and last[1] == key:
        return last[2]
    segments = None if positions_are_contiguous() else segments_from_position_ids(position_ids, batch, n)
    _LAST_PACKING = (weakref.ref(position_ids), key, segments)
    return segments


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


def exact_fallback(query, key, value, attention_mask, segments, causal, dropout, scaling, kwargs) -> torch.Tensor:
    """Exact attention, ``[B, L, Hq, D]``, for a call no kernel takes (``kwargs``: the attention function's).

    Packed causal rows (``segments`` set, no mask, nothing but causality) run one document at a time
    (:func:`packed_causal_attention`): the masked attention's values and gradients without its block-diagonal
    mask, which keeps SDPA off its flash kernel, computes every block of the row and, under deterministic
    kernels, leaves a one-split kernel over 4x slower at 16K (``benchmarks/training/NOTES.md``). Every other
    call is SDPA (plain math for softcap and sinks) under the mask it describes.
    """
    softcap, sliding_window, s_aux = kwargs.get("softcap"), kwargs.get("sliding_window"), kwargs.get("s_aux")
    plain = not (dropout or softcap or sliding_window or s_aux is not None or kwargs.get("output_attentions"))
    if segments is not None and causal and attention_mask is None and plain:
        return packed_causal_attention(query, key, value, segments, scaling)
    if attention_mask is not None and attention_mask.dim() != 2:  # the model's own 4D mask, taken as it is
        mask = attention_mask
        if mask.dtype != torch.bool:  # additive float mask
            mask = mask > torch.finfo(mask.dtype).min / 2
    else:  # a 2D padding mask or none
        mask = _fallback_mask(query.shape[2], key.shape[2], causal, attention_mask, segments, sliding_window,
                              query.device)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return _fallback(query, key, value, mask, dropout, scaling, softcap, s_aux)


def dispatch_device(query: torch.Tensor) -> str | None:
    """The device name the dispatch table is read for, or ``None``: a CPU call runs Sage's reference.

    Example:
        >>> dispatch_device(torch.zeros(1)) is None
        True
    """
    return torch.cuda.get_device_name(query.device) if query.is_cuda else None


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
    # Decode and prefill with a cache never need it: segments only split a training row (q_len == kv_len).
    segments = packed_segments(kwargs.get("position_ids"), query.shape[0], kv_len) if q_len == kv_len else None
    if reason is not None:
        record_fallback(reason)
        return exact_fallback(query, key, value, attention_mask, segments, causal, dropout, scaling, kwargs), None
    # CPU keeps the quantized reference forward (build_model gives CPU runs SDPA anyway); its backward
    # route is NEUTRAIN_SAGE_BACKWARD's (benchmarks/attention/sage_fidelity.py runs the exact one, as a GPU would).
    backward, config, backend = dispatch.cpu_backward(), None, "auto"
    device = dispatch_device(query)
    if device is not None:
        training = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        choice = dispatch.choose(device, head_dim, causal, str(query.dtype).removeprefix("torch."), training, q_len)
        if choice.backend != "sage":
            record_fallback(f"dispatch: {choice.reason}")
            # Exactly what attn_implementation="sdpa" runs, where transformers' function can expand GQA: it
            # repeats K/V by the module's num_key_value_groups, which a bare or foreign module may lack.
            groups = query.shape[1] // key.shape[1]
            if padding is None and segments is None and getattr(module, "num_key_value_groups", 1) == groups:
                return compat.sdpa_attention()(module, query, key, value, None, dropout=0.0, scaling=scaling,
                                               is_causal=causal)
            # No reason above: no dropout, softcap, window or sinks, and any mask is padding.
            return exact_fallback(query, key, value, attention_mask, segments, causal, 0.0, scaling, kwargs), None
        backward, config, backend = choice.backward, dispatch.kernel_config(device, head_dim), choice.kernel
    out = sage_attention(query, key, value, causal=causal, scale=scaling, segment_ids=segments,
                         key_padding_mask=padding, v_residual=knob("NEUTRAIN_SAGE_V_RESIDUAL"), backward=backward,
                         config=config, backend=backend)
    return out.transpose(1, 2).contiguous(), None


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
