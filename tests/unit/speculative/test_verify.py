"""Exactness and acceptance of the single-position rules, by exact enumeration.

Every draft tuple of a tiny vocabulary is enumerated in float64 and the schemes'
internal coins are summed out exactly (``marginal_output``), so the output law
must equal ``p`` and the acceptance must equal each scheme's formula to 1e-12.
"""

import itertools

import pytest
import torch

from neutrain.speculative import SCHEMES, acceptance_formula, marginal_output, p_star, verify_step
from neutrain.speculative.selection import PairFlowRule, PriorityRule, SequentialRule
from neutrain.speculative.spectr import spectr_beta, spectr_rho

TOL = 1e-12


def dirichlet(vocab, concentration, gen):
    x = torch._standard_gamma(torch.full((vocab,), float(concentration), dtype=torch.float64), generator=gen)
    x = x + 1e-300  # never all zero
    return x / x.sum()


def one_hot(vocab, index):
    x = torch.zeros(vocab, dtype=torch.float64)
    x[index] = 1.0
    return x


def norm(values):
    x = torch.tensor(values, dtype=torch.float64)
    return x / x.sum()


def random_pairs(count, seed):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        vocab = [3, 4, 5, 6][i % 4]
        conc = [0.2, 0.5, 1.0, 3.0][(i // 4) % 4]
        out.append((dirichlet(vocab, conc, gen), dirichlet(vocab, conc, gen)))
    return out


EDGE_CASES = {
    "disjoint": (norm([0.5, 0.5, 0, 0, 0]), norm([0, 0, 0.2, 0.3, 0.5])),
    "p_equals_q": (norm([0.1, 0.2, 0.3, 0.4]), norm([0.1, 0.2, 0.3, 0.4])),
    "one_hot_p": (one_hot(5, 2), norm([0.3, 0.1, 0.2, 0.25, 0.15])),
    "one_hot_q": (norm([0.3, 0.1, 0.2, 0.25, 0.15]), one_hot(5, 1)),
    "one_hot_both_equal": (one_hot(4, 3), one_hot(4, 3)),
    "one_hot_both_differ": (one_hot(4, 0), one_hot(4, 3)),
    "p_not_in_q_support": (norm([0.2, 0.3, 0.5, 0, 0]), norm([0, 0.5, 0.2, 0.3, 0])),
    "zero_residual_mass": (norm([0.5, 0.5, 0]), norm([0.5, 0.5, 0])),
    "thm2_accept_one": (norm([1, 1, 1]), norm([1 / 3, 0.2, 1 - 1 / 3 - 0.2])),
}

CASES = list(EDGE_CASES.items()) + [(f"dirichlet{i}", pq) for i, pq in enumerate(random_pairs(12, 7))]


def schemes_for(k):
    return [s for s in SCHEMES if k == 1 or s != "sd"]


@pytest.mark.parametrize("name,pq", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_identical_drafts_exact_and_acceptance_formula(name, pq, k):
    p, q1 = pq
    vocab = p.numel()
    q = q1.expand(k, vocab)
    for scheme in schemes_for(k):
        dist, accepted = marginal_output(scheme, p, q, top_s=vocab)
        assert (dist - p).abs().max().item() < TOL, (scheme, dist, p)
        assert abs(accepted - acceptance_formula(scheme, p, q, top_s=vocab)) < TOL, scheme
    # The formulas themselves, from their definitions (not the library's helpers).
    assert abs(acceptance_formula("specinfer", p, q) - acceptance_formula("specinfer", p, q.flip(0))) < TOL
    if k == 1:
        assert abs(acceptance_formula("sd", p, q) - torch.minimum(p, q1).sum().item()) < TOL


def brute_force_p_star(p, q, k):
    vocab = p.numel()
    best = float("inf")
    for mask in itertools.product([0, 1], repeat=vocab):
        s = torch.tensor(mask, dtype=torch.bool)
        best = min(best, float(p[s].sum()) + 1 - float(q[s].sum()) ** k)
    return min(best, 1.0)


@pytest.mark.parametrize("name,pq", CASES, ids=[c[0] for c in CASES])
def test_spectr_rho_and_acceptance(name, pq):
    p, q = pq
    for k in (2, 3):
        rho = spectr_rho(p, q, k)
        beta = spectr_beta(p, q, rho)
        assert 1.0 <= rho <= k
        gap = 1 - (1 - beta) ** k - rho * beta
        # Either the root of the SpecTr equation, or rho = 1 when the equation has no interior root.
        assert abs(gap) < TOL or (rho == 1.0 and gap <= TOL)
        spectr = acceptance_formula("spectr", p, q.expand(k, -1))
        assert abs(spectr - (1 - (1 - beta) ** k)) < TOL


@pytest.mark.parametrize("name,pq", CASES, ids=[c[0] for c in CASES])
def test_optimum_and_ordering(name, pq):
    p, q = pq
    vocab = p.numel()
    for k in (2, 3):
        brute = brute_force_p_star(p, q, k)
        assert abs(p_star(p, q, k) - brute) < TOL  # the sorted-prefix oracle is the subset minimum
        qk = q.expand(k, vocab)
        importance = acceptance_formula("importance", p, qk, top_s=vocab)
        spectr = acceptance_formula("spectr", p, qk)
        specinfer = acceptance_formula("specinfer", p, qk)
        assert importance >= spectr - TOL  # by construction: SpecTr's coins are a candidate selection
        # P* bounds every exact scheme with K i.i.d. drafts (Khisti et al., Theorem 3).
        assert max(importance, spectr, specinfer) <= brute + TOL
        if k == 2:
            # Untruncated max-flow LP reaches the min-cut optimum P* = min_S [p(S) + 1 - q(S)^2].
            assert abs(torch.minimum(p, PairFlowRule(p, q, top_s=vocab).q_beta).sum().item() - brute) < TOL
            assert abs(importance - brute) < TOL


@pytest.mark.slow
def test_truncated_lp_between_priority_and_optimum():
    gen = torch.Generator().manual_seed(3)
    for _ in range(10):
        p, q = dirichlet(12, 0.5, gen), dirichlet(12, 0.5, gen)
        full = float(torch.minimum(p, PairFlowRule(p, q, top_s=12).q_beta).sum())
        truncated = float(torch.minimum(p, PairFlowRule(p, q, top_s=4).q_beta).sum())
        priority = float(torch.minimum(p, PriorityRule(p, q, 2).q_beta).sum())
        assert priority - TOL <= truncated <= full + TOL
        assert abs(full - p_star(p, q, 2)) < 1e-12
        dist, _ = marginal_output("importance", p, q.expand(2, -1), top_s=4)
        assert (dist - p).abs().max().item() < TOL


def test_selection_rules_are_exact_marginals():
    """q_beta of each rule equals the enumerated law of the selected token."""
    gen = torch.Generator().manual_seed(11)
    p, q = dirichlet(5, 0.7, gen), dirichlet(5, 0.7, gen)
    for k, rule in [(2, PairFlowRule(p, q, 3)), (3, PriorityRule(p, q, 3)), (3, SequentialRule(p, q, 3))]:
        law = torch.zeros(5, dtype=torch.float64)
        for drafts in itertools.product(range(5), repeat=k):
            weight = float(torch.prod(q[list(drafts)]))
            for token, prob in rule.select_probs(list(drafts)).items():
                law[token] += weight * prob
        assert (law - rule.q_beta).abs().max().item() < TOL


def test_specinfer_non_identical_drafts_exact():
    gen = torch.Generator().manual_seed(5)
    for k in (2, 3):
        for _ in range(3):
            p = dirichlet(4, 0.5, gen)
            q = torch.stack([dirichlet(4, 0.5, gen) for _ in range(k)])
            dist, accepted = marginal_output("specinfer", p, q)
            assert (dist - p).abs().max().item() < TOL
            assert abs(accepted - acceptance_formula("specinfer", p, q)) < TOL


@pytest.mark.parametrize("scheme", ["spectr", "importance"])
def test_identical_schemes_reject_different_rows(scheme):
    q = torch.stack([norm([0.5, 0.5]), norm([0.4, 0.6])])
    with pytest.raises(ValueError, match="identical drafts"):
        verify_step(scheme, norm([0.3, 0.7]), q, [0, 1])


def test_importance_uses_the_drafts():
    """Exactness alone passes a scheme that ignores drafts; acceptance must beat single-draft SD."""
    p, q = norm([0.5, 0.3, 0.2, 0.0]), norm([0.1, 0.2, 0.3, 0.4])
    assert acceptance_formula("importance", p, q.expand(2, -1)) > acceptance_formula("sd", p, q) + 0.05


@pytest.mark.slow
@pytest.mark.parametrize("scheme,k", [("sd", 1), ("specinfer", 2), ("spectr", 3), ("importance", 2), ("importance", 3)])
def test_verify_step_samples_the_plan(scheme, k):
    """Monte-Carlo: verify_step's tokens and acceptances follow output_distribution (chi-square)."""
    p, q1 = norm([0.4, 0.3, 0.2, 0.1]), norm([0.1, 0.2, 0.3, 0.4])
    gen = torch.Generator().manual_seed(0)
    n = 3000
    counts = torch.zeros(4, dtype=torch.float64)
    accepted = 0
    for _ in range(n):
        drafts = torch.multinomial(q1, k, replacement=True, generator=gen).tolist()
        token, index = verify_step(scheme, p, q1.expand(k, -1), drafts, gen)
        counts[token] += 1
        if index is not None:
            assert drafts[index] == token
            accepted += 1
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 16.27  # chi-square, 3 dof, p = 0.001
    rate = acceptance_formula(scheme, p, q1.expand(k, -1))
    assert abs(accepted / n - rate) < 4 * (rate * (1 - rate) / n) ** 0.5 + 1e-9
