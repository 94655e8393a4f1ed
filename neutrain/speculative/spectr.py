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


def spectr_rho(p: torch.Tensor, q: torch.Tensor, num_drafts: int, iters: int = 200) -> float:
    """Solve ``1 - (1 - beta(rho))^K = rho * beta(rho)`` for ``rho`` in ``[1, K]``.

    Example:
        >>> p = torch.tensor([0.5, 0.5], dtype=torch.float64)
        >>> spectr_rho(p, p, 1)
        1.0
    """

    def gap(rho: float) -> float:
        beta = spectr_beta(p, q, rho)
        return 1 - (1 - beta) ** num_drafts - rho * beta

    lo, hi = 1.0, float(num_drafts)
    if gap(lo) <= 0:
        return lo
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if gap(mid) > 0:
            lo = mid
        else:
            hi = mid
    return hi


def spectr_acceptance(p: torch.Tensor, q: torch.Tensor, num_drafts: int) -> float:
    """SpecTr's acceptance probability ``1 - (1 - beta(rho*))^K``."""
    beta = spectr_beta(p, q, spectr_rho(p, q, num_drafts))
    return 1 - (1 - beta) ** num_drafts
