"""SpecTr K-SEQ quantities (Sun et al., arXiv 2310.15141), with the draft called ``q``.

``beta(rho) = sum_x min(q(x), p(x)/rho)``; ``rho*`` in ``[1, K]`` solves
``1 - (1 - beta(rho))^K = rho * beta(rho)``. The left side falls and the right
side rises in ``rho``, so bisection converges; we return the upper end of the
final bracket, where ``1 - (1-beta)^K <= rho * beta``. That inequality is
exactly what keeps SpecTr's residual ``p - c * min(q, p/rho)`` non-negative
(``c = (1-(1-beta)^K)/beta <= rho``), so exactness never hinges on the last bit
of the root.
"""

from __future__ import annotations

import torch


def spectr_beta(p: torch.Tensor, q: torch.Tensor, rho: float) -> float:
    """``beta(rho) = sum(min(q, p / rho))``."""
    return float(torch.minimum(q, p / rho).sum())


def spectr_rho(p: torch.Tensor, q: torch.Tensor, num_drafts: int, iters: int = 200, order: torch.Tensor | None = None) -> float:
    """Solve ``1 - (1 - beta(rho))^K = rho * beta(rho)`` for ``rho`` in ``[1, K]``.

    ``beta`` is piecewise ``A + B/rho`` between the sorted ratios ``p/q``, so the
    gap is evaluated at every breakpoint in one vectorised pass (no per-step
    device syncs on GPU), and a scalar bisection finishes inside the bracketing
    piece.

    Example:
        >>> p = torch.tensor([0.5, 0.5], dtype=torch.float64)
        >>> spectr_rho(p, p, 1)
        1.0
    """
    k = num_drafts
    safe_q = torch.where(q > 0, q, torch.ones_like(q))
    ratio = torch.where(q > 0, p / safe_q, torch.full_like(p, float("inf")))
    order = torch.sort(ratio).indices if order is None else order
    r, ps, qs = ratio[order], p[order], q[order]
    zero = torch.zeros(1, dtype=p.dtype, device=p.device)
    # Piece j (rho between r[j-1] and r[j]): tokens < j contribute p/rho, tokens >= j contribute q.
    below_p = torch.cat([zero, torch.cumsum(ps, 0)])
    above_q = q.sum() - torch.cat([zero, torch.cumsum(qs, 0)])
    ends = torch.tensor([1.0, float(k)], dtype=p.dtype, device=p.device)
    points = torch.cat([ends[:1], r.clamp(1.0, float(k)), ends[1:]])  # sorted, since r is
    piece = torch.searchsorted(r, points, right=False)  # tokens with ratio < rho
    beta = above_q[piece] + below_p[piece] / points
    gap = 1 - (1 - beta) ** k - points * beta
    nonpositive = (gap <= 0).nonzero()
    first = int(nonpositive[0]) if nonpositive.numel() else points.numel() - 1
    if first == 0:
        return float(points[0])
    lo, hi = float(points[first - 1]), float(points[first])
    j = int(torch.searchsorted(r, torch.tensor([0.5 * (lo + hi)], dtype=r.dtype, device=r.device)))
    a_const, b_const = float(above_q[j]), float(below_p[j])

    def gap_at(rho: float) -> float:
        b = a_const + b_const / rho
        return 1 - (1 - b) ** k - rho * b

    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if gap_at(mid) > 0:
            lo = mid
        else:
            hi = mid
    return hi


def spectr_acceptance(p: torch.Tensor, q: torch.Tensor, num_drafts: int) -> float:
    """SpecTr's acceptance probability ``1 - (1 - beta(rho*))^K``."""
    beta = spectr_beta(p, q, spectr_rho(p, q, num_drafts))
    return 1 - (1 - beta) ** num_drafts
