"""Single-position verification rules for (multi-draft) speculative sampling.

Every scheme is written as a *plan*: given the target ``p``, the drafts'
distributions ``q`` and the drafted tokens, the plan lists the exact
probability of accepting each draft, plus the probability of rejecting all of
them and the residual distribution sampled on rejection. :func:`verify_step`
samples one outcome of the plan; :func:`output_distribution` sums the plan
into the exact law of the output. Both run the same code, so the enumeration
tests in ``tests/unit/speculative`` check what sampling does.

Schemes (pseudo-code in ``docs/specdec.md`` §10):

* ``"sd"`` -- single draft (Leviathan et al.; Chen et al.): accept ``x`` with
  ``min(1, p(x)/q(x))``, else sample ``norm((p - q)^+)``.
* ``"specinfer"`` -- recursive rejection (Miao et al., SpecInfer Alg. 2): try the
  drafts in a random order that ignores their values; each stage is single-draft
  SD onto the current residual. Drafts may come from different ``q`` rows.
* ``"spectr"`` -- SpecTr K-SEQ for K identical drafts.
* ``"importance"`` -- canonical two-step scheme (Khisti et al.): importance
  selection (:mod:`neutrain.speculative.selection`), then single-draft SD from
  ``q_beta`` to ``p``.

All computations run in float64: the acceptance coins compare probabilities
that may differ in the 8th digit.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

from neutrain.speculative.selection import choose_rule
from neutrain.speculative.spectr import spectr_acceptance, spectr_beta, spectr_rho

SCHEMES = ("sd", "specinfer", "spectr", "importance")


@dataclass
class Plan:
    """Exact outcome probabilities of one verification, given the drafts.

    ``accepted`` holds ``(probability, token, draft_index)``; with probability
    ``reject`` the output is drawn from ``residual`` instead.
    """

    accepted: list[tuple[float, int, int]] = field(default_factory=list)
    reject: float = 0.0
    residual: torch.Tensor | None = None


def accept_probability(p_x: float, q_x: float) -> float:
    """``min(1, p_x / q_x)``; a token the draft never proposes (``q_x = 0``) counts as accepted if ``p_x > 0``."""
    if p_x <= 0.0:
        return 0.0
    if q_x <= p_x:
        return 1.0
    return p_x / q_x


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm((p - q)^+)``, or ``p`` when that has no mass (then rejection has probability 0)."""
    r = (p - q).clamp_min(0.0)
    total = float(r.sum())
    return r / total if total > 0 else p


def _check_inputs(scheme: str, p: torch.Tensor, q: torch.Tensor, drafts) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; expected one of {SCHEMES}")
    p = p.to(torch.float64)
    q = q.to(torch.float64)
    if q.dim() == 1:
        q = q.unsqueeze(0)
    drafts = [int(x) for x in (drafts.tolist() if torch.is_tensor(drafts) else drafts)]
    if q.shape[0] != len(drafts):
        raise ValueError(f"q has {q.shape[0]} rows but {len(drafts)} drafts were given")
    if q.shape[1] != p.shape[0]:
        raise ValueError(f"p has {p.shape[0]} entries but q rows have {q.shape[1]}")
    if scheme == "sd" and len(drafts) != 1:
        raise ValueError(f"scheme 'sd' takes exactly one draft, got {len(drafts)}")
    if scheme in ("spectr", "importance") and len(drafts) > 1:
        spread = float((q - q[0]).abs().max())
        if spread > 1e-9:
            raise ValueError(
                f"scheme {scheme!r} assumes identical drafts (i.i.d. from one q), but the rows of q differ "
                f"(max |q_k - q_0| = {spread:.3g}); use 'specinfer' for drafts from different distributions"
            )
    return p, q, drafts


def _plan_sd(p: torch.Tensor, q: torch.Tensor, token: int, index: int = 0) -> Plan:
    a = accept_probability(float(p[token]), float(q[token]))
    return Plan([(a, token, index)], 1.0 - a, residual(p, q))


def _plan_specinfer(p: torch.Tensor, q: torch.Tensor, drafts: list[int], order: list[int]) -> Plan:
    plan, reach, current = Plan(), 1.0, p
    for k in order:
        x = drafts[k]
        a = accept_probability(float(current[x]), float(q[k, x]))
        plan.accepted.append((reach * a, x, k))
        reach *= 1.0 - a
        current = residual(current, q[k])
    plan.reject, plan.residual = reach, current
    return plan


def _plan_spectr(p: torch.Tensor, q: torch.Tensor, drafts: list[int]) -> Plan:
    k_drafts = len(drafts)
    rho = spectr_rho(p, q, k_drafts)
    plan, reach = Plan(), 1.0
    for k, x in enumerate(drafts):
        a = accept_probability(float(p[x]) / rho, float(q[x]))
        plan.accepted.append((reach * a, x, k))
        reach *= 1.0 - a
    m = torch.minimum(q, p / rho)
    beta = float(m.sum())
    c = (1 - (1 - beta) ** k_drafts) / beta if beta > 0 else 0.0
    plan.reject = reach
    # Mass balance forces this residual; c <= rho keeps it non-negative (spectr.py).
    plan.residual = residual(p, c * m)
    return plan


def _plan_importance(p: torch.Tensor, q: torch.Tensor, drafts: list[int], top_s: int) -> Plan:
    if len(drafts) == 1:
        return _plan_sd(p, q, drafts[0])
    rule = choose_rule(p, q, len(drafts), top_s)
    plan = Plan()
    for token, chosen in rule.select_probs(drafts).items():
        a = accept_probability(float(p[token]), float(rule.q_beta[token]))
        plan.accepted.append((chosen * a, token, drafts.index(token)))
        plan.reject += chosen * (1.0 - a)
    plan.residual = residual(p, rule.q_beta)
    return plan


def make_plan(scheme: str, p: torch.Tensor, q: torch.Tensor, drafts: list[int], order=None, top_s: int = 5) -> Plan:
    """The plan of ``scheme`` for these drafts (inputs already checked, float64, ``q`` is ``[K, V]``)."""
    if scheme == "sd":
        return _plan_sd(p, q[0], drafts[0])
    if scheme == "specinfer":
        return _plan_specinfer(p, q, drafts, list(range(len(drafts))) if order is None else order)
    if scheme == "spectr":
        return _plan_spectr(p, q[0], drafts)
    return _plan_importance(p, q[0], drafts, top_s)


def _uniform(generator: torch.Generator | None, device) -> float:
    device = generator.device if generator is not None else device
    return float(torch.rand((), generator=generator, device=device, dtype=torch.float64))


def sample_from(dist: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """Inverse-CDF sample of a categorical; a zero-probability token is never returned."""
    cdf = torch.cumsum(dist.to(torch.float64), 0)
    value = _uniform(generator, dist.device) * float(cdf[-1])
    index = int(torch.searchsorted(cdf, torch.tensor([value], dtype=cdf.dtype, device=cdf.device), right=True))
    return min(index, dist.numel() - 1)


def verify_step(scheme: str, p: torch.Tensor, q: torch.Tensor, drafts, generator: torch.Generator | None = None, top_s: int = 5):
    """Verify K drafted tokens against the target at one position.

    Args:
        scheme: ``"sd"`` (K = 1), ``"specinfer"``, ``"spectr"`` or ``"importance"``.
        p: target probabilities ``[V]``.
        q: draft probabilities ``[K, V]`` (or ``[V]`` for one draft); row k is
            the distribution draft k was sampled from.
        drafts: the K proposed token ids.
        generator: optional ``torch.Generator`` on ``p``'s device.
        top_s: tokens in the truncated K = 2 optimal selection (``"importance"``).

    Returns:
        ``(token, index)``: the output token, distributed exactly as ``p`` when
        the drafts are independent samples of their ``q`` rows, and the index of
        the accepted draft, or ``None`` when the token came from the residual.

    Example:
        >>> p = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
        >>> q = torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]], dtype=torch.float64)
        >>> token, index = verify_step("specinfer", p, q, [0, 2], torch.Generator().manual_seed(0))
        >>> token in (0, 1, 2)
        True
    """
    p, q, drafts = _check_inputs(scheme, p, q, drafts)
    order = None
    if scheme == "specinfer":
        device = generator.device if generator is not None else p.device
        keys = torch.rand(len(drafts), generator=generator, device=device, dtype=torch.float64)
        order = torch.argsort(keys).tolist()  # random order, independent of the drafted values
    plan = make_plan(scheme, p, q, drafts, order, top_s)
    u = _uniform(generator, p.device)
    for prob, token, index in plan.accepted:
        if u < prob:
            return token, index
        u -= prob
    return sample_from(plan.residual, generator), None


def output_distribution(scheme: str, p: torch.Tensor, q: torch.Tensor, drafts, top_s: int = 5) -> tuple[torch.Tensor, float]:
    """Exact law of :func:`verify_step`'s output for fixed drafts, and its acceptance probability.

    The scheme's internal coins are summed out exactly (for ``"specinfer"`` this
    averages over all K! trial orders).
    """
    p, q, drafts = _check_inputs(scheme, p, q, drafts)
    orders = list(itertools.permutations(range(len(drafts)))) if scheme == "specinfer" else [None]
    dist = torch.zeros_like(p)
    accepted = 0.0
    for order in orders:
        plan = make_plan(scheme, p, q, drafts, None if order is None else list(order), top_s)
        for prob, token, _ in plan.accepted:
            dist[token] += prob / len(orders)
            accepted += prob / len(orders)
        dist += plan.reject / len(orders) * plan.residual
    return dist, accepted


def marginal_output(scheme: str, p: torch.Tensor, q: torch.Tensor, top_s: int = 5) -> tuple[torch.Tensor, float]:
    """Exact output law and acceptance, enumerating every draft tuple (V^K of them: tests only)."""
    q = q.to(torch.float64)
    q = q.unsqueeze(0) if q.dim() == 1 else q
    vocab = q.shape[1]
    dist = torch.zeros(vocab, dtype=torch.float64)
    accepted = 0.0
    for drafts in itertools.product(range(vocab), repeat=q.shape[0]):
        weight = math.prod(float(q[k, x]) for k, x in enumerate(drafts))
        if weight == 0.0:
            continue
        d, a = output_distribution(scheme, p, q, list(drafts), top_s)
        dist += weight * d
        accepted += weight * a
    return dist, accepted


def acceptance_formula(scheme: str, p: torch.Tensor, q: torch.Tensor, top_s: int = 5) -> float:
    """Each scheme's analytic acceptance probability (identical drafts for spectr/importance).

    * sd: ``sum(min(p, q))``
    * specinfer: ``1 - mean_order prod_k (1 - sum(min(p_{k-1}, q_k)))`` with residuals ``p_k``
    * spectr: ``1 - (1 - beta(rho*))^K``
    * importance: ``sum(min(p, q_beta))``
    """
    p = p.to(torch.float64)
    q = q.to(torch.float64)
    q = q.unsqueeze(0) if q.dim() == 1 else q
    k_drafts = q.shape[0]
    if scheme == "sd" or (scheme == "importance" and k_drafts == 1):
        return float(torch.minimum(p, q[0]).sum())
    if scheme == "spectr":
        return spectr_acceptance(p, q[0], k_drafts)
    if scheme == "importance":
        rule = choose_rule(p, q[0], k_drafts, top_s)
        return float(torch.minimum(p, rule.q_beta).sum())
    orders = list(itertools.permutations(range(k_drafts)))
    total = 0.0
    for order in orders:
        current, miss = p, 1.0
        for k in order:
            miss *= 1.0 - float(torch.minimum(current, q[k]).sum())
            current = residual(current, q[k])
        total += 1.0 - miss
    return total / len(orders)


__all__ = [
    "SCHEMES",
    "Plan",
    "acceptance_formula",
    "make_plan",
    "marginal_output",
    "output_distribution",
    "residual",
    "sample_from",
    "spectr_beta",
    "spectr_rho",
    "verify_step",
]
