"""Importance selection rules for the canonical two-step multi-draft scheme.

Khisti et al. (arXiv 2410.18234, Theorem 1) split every optimal multi-draft
verifier into two steps: *select* one of the K drafted tokens with a rule
``beta``, then run single-draft speculative sampling from the induced marginal
``q_beta`` of the selected token onto the target ``p``. Any rule is exact as
long as ``q_beta`` is the true marginal; the rule only decides the acceptance
``sum(min(p, q_beta))``.

This module holds the rules for K identical, independent drafts from ``q``:

* :class:`PriorityRule` -- select the present token ranked highest by a fixed
  score (max-ratio ``p/q`` by default). ``q_beta(pi_j) = Q_<=j^K - Q_<j^K`` with
  ``pi`` in ascending priority (docs/specdec.md §1.4).
* :class:`SequentialRule` -- SpecTr's K-SEQ acceptance coins used as a
  selection rule (fallback: the first draft). Its two-step acceptance is at
  least SpecTr's ``1 - (1 - beta(rho*))^K`` because ``q_beta >= c * m`` with
  ``c * m <= p`` (derived here, checked by enumeration in the tests).
* :class:`PairFlowRule` -- K = 2: the optimal pair weights over the top-s tokens
  (by draft probability), solved exactly as a bipartite max-flow (the LP of
  the paper is a transportation problem, so max-flow gives its exact optimum
  without an LP solver), and max-ratio priority for every other pair.

:func:`choose_rule` picks among them from ``(p, q)`` alone, which keeps the
scheme exact, and never falls below SpecTr because the sequential rule is
always a candidate. :func:`p_star` is the K-draft optimum
``min_S [p(S) + 1 - q(S)^K]`` via the sorted-prefix oracle.
"""

from __future__ import annotations

import torch

from neutrain.speculative.spectr import spectr_rho, spectr_beta


def ratio_scores(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``p/q`` with ``q == 0`` mapped to ``+inf`` (such tokens are never drafted)."""
    safe_q = torch.where(q > 0, q, torch.ones_like(q))
    return torch.where(q > 0, p / safe_q, torch.full_like(p, float("inf")))


def ascending_order(scores: torch.Tensor) -> torch.Tensor:
    """Token ids sorted by ascending score, ties broken by ascending id (deterministic)."""
    # A stable sort keeps equal scores in id order, so the rule depends on (p, q) alone.
    return torch.sort(scores, stable=True).indices


def p_star(p: torch.Tensor, q: torch.Tensor, num_drafts: int) -> float:
    """Optimal acceptance ``min_S [p(S) + 1 - q(S)^K]`` for K i.i.d. drafts from ``q``.

    The minimising set is a prefix of tokens sorted by ascending ``p/q``
    (docs/specdec.md §1.3), so this costs one sort and a cumulative sum.

    Example:
        >>> p = torch.tensor([0.5, 0.5], dtype=torch.float64)
        >>> round(p_star(p, p, 1), 12)
        1.0
    """
    order = ascending_order(ratio_scores(p, q))
    zero = torch.zeros(1, dtype=p.dtype, device=p.device)
    cum_p = torch.cat([zero, torch.cumsum(p[order], 0)])
    cum_q = torch.cat([zero, torch.cumsum(q[order], 0)])
    return float((cum_p + 1 - cum_q.clamp(max=1.0) ** num_drafts).min().clamp(max=1.0))


class PriorityRule:
    """Select the present draft token with the highest priority.

    Args:
        p: target probabilities ``[V]``.
        q: draft probabilities ``[V]`` (all K drafts identical).
        num_drafts: K.
        scores: priority per token (higher wins); defaults to ``p/q``.
        order: token ids in ascending priority, if already sorted (overrides ``scores``).
    """

    name = "priority"

    def __init__(
        self, p: torch.Tensor, q: torch.Tensor, num_drafts: int, scores: torch.Tensor | None = None,
        order: torch.Tensor | None = None,
    ):
        if order is None:
            order = ascending_order(ratio_scores(p, q) if scores is None else scores)
        # rank[token] = position in ascending priority; the larger rank wins.
        self.rank = torch.empty_like(order)
        self.rank[order] = torch.arange(order.numel(), device=order.device)
        cum = torch.cumsum(q[order], 0).clamp(max=1.0)
        below = torch.cat([torch.zeros_like(cum[:1]), cum[:-1]])
        q_beta = torch.empty_like(q)
        q_beta[order] = cum**num_drafts - below**num_drafts
        self.q_beta = q_beta

    def winner(self, a: int, b: int) -> int:
        return a if int(self.rank[a]) > int(self.rank[b]) else b

    def select_probs(self, drafts: list[int]) -> dict[int, float]:
        best = drafts[0]
        for token in drafts[1:]:
            best = self.winner(best, token)
        return {best: 1.0}


class SequentialRule:
    """SpecTr's sequential acceptance coins, used as a selection rule.

    Draft ``i`` is chosen with probability ``min(1, p/(rho q))`` in turn; if no
    coin succeeds the first draft is chosen. Then
    ``q_beta = c*m + (1-beta)^(K-1) * (q - m)`` with ``m = min(q, p/rho)`` and
    ``c = (1 - (1-beta)^K)/beta``.
    """

    name = "sequential"

    def __init__(self, p: torch.Tensor, q: torch.Tensor, num_drafts: int, order: torch.Tensor | None = None):
        self.rho = spectr_rho(p, q, num_drafts, order=order)
        self.coin = torch.where(q > 0, torch.clamp(p / (self.rho * torch.where(q > 0, q, 1.0)), max=1.0), 1.0)
        m = torch.minimum(q, p / self.rho)
        beta = float(m.sum())
        c = (1 - (1 - beta) ** num_drafts) / beta if beta > 0 else 0.0
        self.q_beta = c * m + (1 - beta) ** (num_drafts - 1) * (q - m)

    def select_probs(self, drafts: list[int]) -> dict[int, float]:
        probs: dict[int, float] = {}
        reach = 1.0
        for token in drafts:
            a = float(self.coin[token])
            probs[token] = probs.get(token, 0.0) + reach * a
            reach *= 1 - a
        probs[drafts[0]] = probs.get(drafts[0], 0.0) + reach
        return probs


def _max_flow(capacity: list[list[float]], source: int, sink: int) -> list[list[float]]:
    """Edmonds-Karp on a small dense graph; returns the flow matrix.

    Graphs here have at most s(s-1)/2 + s + 2 nodes (s = top-s tokens), so the
    pure-Python loops cost well under a millisecond for s = 5.
    """
    n = len(capacity)
    flow = [[0.0] * n for _ in range(n)]
    eps = 1e-18
    while True:
        parent = [-1] * n
        parent[source] = source
        frontier = [source]
        while frontier and parent[sink] < 0:
            nxt = []
            for u in frontier:
                for v in range(n):
                    if parent[v] < 0 and capacity[u][v] - flow[u][v] > eps:
                        parent[v] = u
                        nxt.append(v)
            frontier = nxt
        if parent[sink] < 0:
            return flow
        push, v = float("inf"), sink
        while v != source:
            u = parent[v]
            push = min(push, capacity[u][v] - flow[u][v])
            v = u
        v = sink
        while v != source:
            u = parent[v]
            flow[u][v] += push
            flow[v][u] -= push
            v = u


class PairFlowRule:
    """K = 2 optimal selection on the top-s tokens, max-ratio priority elsewhere.

    For identical drafts the LP variable is ``w[i, j] = P(select i | drafts {i, j})``.
    Pairs with both tokens among the ``top_s`` most likely draft tokens are free;
    every other pair (and ``{y, y}``) is fixed by max-ratio priority, whose mass
    ``fixed`` comes from the closed form of :class:`PriorityRule`. Maximising
    ``sum_y min(p_y, fixed_y + g_y)`` over the free routing ``g`` is a max-flow
    from pairs (capacity ``2 q_i q_j``) to tokens (capacity ``(p_y - fixed_y)^+``),
    solved exactly. With ``top_s >= V`` the value is the optimum ``P*``.
    """

    name = "pair_flow"

    def __init__(self, p: torch.Tensor, q: torch.Tensor, top_s: int = 5, order: torch.Tensor | None = None):
        self.priority = PriorityRule(p, q, 2, order=order)
        s = min(top_s, int((q > 0).sum()))
        # topk is O(V); ties resolve deterministically for given (p, q), which is all exactness needs.
        top = torch.topk(q, s).indices.tolist()
        self.top = top
        qv = q[top].tolist()
        fixed = self.priority.q_beta.clone()
        pairs = [(a, b) for a in range(s) for b in range(a + 1, s)]
        for a, b in pairs:  # take the free pairs' priority mass back out of `fixed`
            fixed[self.priority.winner(top[a], top[b])] -= 2 * qv[a] * qv[b]
        fixed = fixed.clamp_min(0.0)
        cap_tokens = (p[top] - fixed[top]).clamp_min(0.0).tolist()
        n = 2 + len(pairs) + s
        source, sink = 0, n - 1
        cap = [[0.0] * n for _ in range(n)]
        for k, (a, b) in enumerate(pairs):
            cap[source][1 + k] = 2 * qv[a] * qv[b]
            cap[1 + k][1 + len(pairs) + a] = float("inf")
            cap[1 + k][1 + len(pairs) + b] = float("inf")
        for a in range(s):
            cap[1 + len(pairs) + a][sink] = cap_tokens[a]
        flow = _max_flow(cap, source, sink)
        self.weight: dict[tuple[int, int], float] = {}
        routed = [0.0] * s
        for k, (a, b) in enumerate(pairs):
            mass = cap[source][1 + k]
            to_b = min(max(flow[1 + k][1 + len(pairs) + b], 0.0), mass)
            # Unrouted mass may go anywhere without lowering the objective; it goes to `a`.
            w = (mass - to_b) / mass if mass > 0 else 1.0
            w = min(max(w, 0.0), 1.0)
            self.weight[(top[a], top[b])] = w
            self.weight[(top[b], top[a])] = 1.0 - w
            routed[a] += mass * w
            routed[b] += mass * (1.0 - w)
        q_beta = fixed.clone()
        q_beta[top] += torch.tensor(routed, dtype=q.dtype, device=q.device)
        self.q_beta = q_beta

    def select_probs(self, drafts: list[int]) -> dict[int, float]:
        x1, x2 = drafts
        if x1 == x2:
            return {x1: 1.0}
        w = self.weight.get((x1, x2))
        if w is None:
            return {self.priority.winner(x1, x2): 1.0}
        return {x1: w, x2: 1.0 - w}


def two_step_acceptance(p: torch.Tensor, q_beta: torch.Tensor) -> float:
    """Acceptance of the two-step scheme: ``sum(min(p, q_beta))``."""
    return float(torch.minimum(p, q_beta).sum())


def choose_rule(p: torch.Tensor, q: torch.Tensor, num_drafts: int, top_s: int = 5):
    """The selection rule the ``"importance"`` scheme uses, chosen from ``(p, q)`` alone.

    K = 2: the truncated optimal pair rule. K >= 3: max-ratio priority. In both
    cases SpecTr's sequential rule is a candidate too, and the rule with the
    larger two-step acceptance wins, so acceptance never falls below SpecTr's.

    Example:
        >>> p = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
        >>> q = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
        >>> rule = choose_rule(p, q, 2)
        >>> round(float(rule.q_beta.sum()), 12)
        1.0
    """
    order = ascending_order(ratio_scores(p, q))  # one sort serves both candidates
    first = PairFlowRule(p, q, top_s, order) if num_drafts == 2 else PriorityRule(p, q, num_drafts, order=order)
    second = SequentialRule(p, q, num_drafts, order)
    if two_step_acceptance(p, second.q_beta) > two_step_acceptance(p, first.q_beta):
        return second
    return first


__all__ = [
    "PairFlowRule",
    "PriorityRule",
    "SequentialRule",
    "ascending_order",
    "choose_rule",
    "p_star",
    "ratio_scores",
    "spectr_beta",
    "two_step_acceptance",
]
