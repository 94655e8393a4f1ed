"""Draft-distillation divergences and the acceptance rate of a draft.

DistillSpec (Zhou et al., arXiv 2310.08461) found no universally best
divergence between the target ``p`` and the draft ``q``: forward KL, reverse
KL, total variation and JSD[beta] each win on some task, so all four are
selectable. TVD is tied directly to speculative decoding: the single-draft
acceptance is ``alpha = sum(min(p, q)) = 1 - TV(p, q)``.

Every function takes logits ``[..., V]`` and an optional ``mask`` over the
leading dimensions (1 = counted), and averages over counted positions. The
target side should be detached by the caller; gradients flow into the draft.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

DIVERGENCES = ("fkl", "rkl", "tvd", "jsd")


def _masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return values.mean()
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """``sum_v a (log a - log b)`` from log-probabilities; terms with ``a = 0`` count 0."""
    a = log_a.exp()
    return torch.where(a > 0, a * (log_a - log_b), torch.zeros_like(a)).sum(-1)


def token_divergence(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    kind: str = "fkl",
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    beta: float = 0.5,
) -> torch.Tensor:
    """Mean per-token divergence between target ``p`` and draft ``q`` distributions.

    Args:
        target_logits: ``[..., V]`` target logits (detach them for distillation).
        draft_logits: ``[..., V]`` draft logits.
        kind: ``"fkl"`` = KL(p||q), ``"rkl"`` = KL(q||p), ``"tvd"`` = 0.5 sum|p - q|,
            ``"jsd"`` = beta KL(p||m) + (1-beta) KL(q||m) with m = beta p + (1-beta) q.
        mask: ``[...]``, positions to count (1) or skip (0).
        temperature: both distributions are ``softmax(logits / temperature)``.
        beta: JSD mixing weight.

    Example:
        >>> t = torch.randn(2, 3, 5)
        >>> float(token_divergence(t, t, "jsd")) < 1e-6
        True
    """
    if kind not in DIVERGENCES:
        raise ValueError(f"unknown divergence {kind!r}; expected one of {DIVERGENCES}")
    # float32 at least: bf16 log-softmax loses the small differences these losses measure.
    dtype = torch.promote_types(draft_logits.dtype, torch.float32)
    log_p = torch.log_softmax(target_logits.to(dtype) / temperature, -1)
    log_q = torch.log_softmax(draft_logits.to(dtype) / temperature, -1)
    if kind == "fkl":
        per_token = _kl(log_p, log_q)
    elif kind == "rkl":
        per_token = _kl(log_q, log_p)
    elif kind == "tvd":
        per_token = 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)
    else:
        if not 0.0 < beta < 1.0:
            raise ValueError("JSD needs 0 < beta < 1")
        log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log(1 - beta))
        per_token = beta * _kl(log_p, log_m) + (1 - beta) * _kl(log_q, log_m)
    return _masked_mean(per_token, mask)


def token_acceptance(
    target_logits: torch.Tensor, draft_logits: torch.Tensor, mask: torch.Tensor | None = None, temperature: float = 1.0
) -> torch.Tensor:
    """Mean single-draft acceptance ``sum(min(p, q))`` (temperature 0: argmax agreement)."""
    if temperature == 0:
        per_token = (target_logits.argmax(-1) == draft_logits.argmax(-1)).to(torch.float32)
    else:
        p = torch.softmax(target_logits.float() / temperature, -1)
        q = torch.softmax(draft_logits.float() / temperature, -1)
        per_token = torch.minimum(p, q).sum(-1)
    return _masked_mean(per_token, mask)


@torch.no_grad()
def acceptance_rate(target, draft, batches: Iterable[dict], temperature: float = 1.0) -> float:
    """Acceptance rate ``alpha = E[sum(min(p, q))]`` of ``draft`` against ``target`` on held-out data.

    Each batch holds ``input_ids`` and optionally ``attention_mask``; every
    next-token distribution after a real (unmasked) token counts once.

    Example:
        >>> alpha = acceptance_rate(target, draft, [{"input_ids": ids}])  # doctest: +SKIP
    """
    total, count = 0.0, 0.0
    for batch in batches:
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        device = next(target.parameters()).device
        ids = ids.to(device)
        mask = torch.ones_like(ids) if mask is None else mask.to(device)
        p_logits = target(input_ids=ids, attention_mask=mask).logits
        q_logits = draft(input_ids=ids.to(next(draft.parameters()).device), attention_mask=mask.to(ids.device)).logits
        weight = float(mask.sum())
        total += float(token_acceptance(p_logits, q_logits.to(device), mask, temperature)) * weight
        count += weight
    return total / max(count, 1.0)
