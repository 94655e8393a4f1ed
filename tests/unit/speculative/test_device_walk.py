"""The device walk (SD, SpecInfer at T > 0) commits tokens with the target's law.

A Markov target and Markov drafts over 3 tokens: chains drawn from the drafts, the walk run on them,
and the first two committed tokens (the second drawn from the target when a round commits only one)
must follow the target's two-step law (chi-square), and not the drafts'.
"""

import pytest
import torch

from neutrain.speculative.device_walk import device_walk
from tests.unit.speculative.test_generate import chi_square, chi_square_threshold

P = torch.tensor([[0.6, 0.3, 0.1], [0.1, 0.2, 0.7], [0.3, 0.3, 0.4]], dtype=torch.float64)
Q = [torch.tensor([[0.2, 0.5, 0.3], [0.5, 0.4, 0.1], [0.1, 0.1, 0.8]], dtype=torch.float64),
     torch.tensor([[0.4, 0.2, 0.4], [0.3, 0.3, 0.4], [0.6, 0.2, 0.2]], dtype=torch.float64),
     torch.tensor([[0.1, 0.1, 0.8], [0.2, 0.6, 0.2], [0.3, 0.5, 0.2]], dtype=torch.float64)]


def _round(k, dl, identical, gen, root=0):
    """Chains drawn from the drafts; the target's and drafts' laws at every node of the fixed layout."""
    tokens = torch.zeros(k, dl, dtype=torch.long)
    q = torch.zeros(k, dl, 3, dtype=torch.float64)
    p = torch.zeros(1 + k * dl, 3, dtype=torch.float64)
    p[0] = P[root]
    for c in range(k):
        law, prev = (Q[0] if identical else Q[c]), root
        for d in range(dl):
            q[c, d] = law[prev]
            tokens[c, d] = int(torch.multinomial(q[c, d], 1, generator=gen))
            prev = int(tokens[c, d])
            p[1 + c * dl + d] = P[prev]
    return p, q, tokens


@pytest.mark.slow
@pytest.mark.parametrize("k,identical", [(1, True), (2, True), (3, True), (2, False), (3, False)])
def test_committed_tokens_follow_the_target(k, identical):
    gen = torch.Generator().manual_seed(k + 10 * identical)
    n, dl, counts, accepted, lengths = 3000, 2, {}, 0, set()
    for _ in range(n):
        p, q, tokens = _round(k, dl, identical, gen)
        out = device_walk(p, q, tokens, identical, gen).tolist()
        count, chain, verified, accepted_now = out[dl + 1:]
        committed = out[:count]
        assert 1 <= count <= dl + 1 and verified == min(count, dl) and accepted_now == count - 1
        assert tokens[chain, : count - 1].tolist() == committed[: count - 1]  # the chain holds the accepted prefix
        if count == 1:
            committed.append(int(torch.multinomial(P[committed[0]], 1, generator=gen)))
        key = tuple(committed[:2])
        counts[key] = counts.get(key, 0) + 1
        accepted += accepted_now
        lengths.add(count)
    law = {(a, b): float(P[0, a] * P[a, b]) for a in range(3) for b in range(3)}
    stat, dof = chi_square(counts, law, n)
    assert stat < chi_square_threshold(dof), (stat, dof)
    draft = {(a, b): float(Q[0][0, a] * Q[0][a, b]) for a in range(3) for b in range(3)}
    assert chi_square(counts, draft, n)[0] > 3 * chi_square_threshold(dof)  # the test tells the laws apart
    assert lengths == {1, 2, 3} and accepted > 0.3 * n


@pytest.mark.slow
def test_acceptance_at_the_root_is_the_schemes_formula():
    """K = 1: the first position is accepted with probability sum(min(p, q)) (SD)."""
    from neutrain.speculative.verify import acceptance_formula

    gen = torch.Generator().manual_seed(5)
    n, hits = 4000, 0
    for _ in range(n):
        p, q, tokens = _round(1, 1, True, gen)
        hits += device_walk(p, q, tokens, True, gen)[-1].item()
    want = acceptance_formula("sd", P[0], Q[0][0])
    assert abs(hits / n - want) < 4 * (want * (1 - want) / n) ** 0.5, (hits / n, want)


@pytest.mark.slow
def test_generate_walks_sd_and_specinfer_on_the_device_and_fetches_only_the_outcome():
    """``generate(engine=True)`` at T > 0: SD/SpecInfer rounds fetch ``draft_len + 5`` ints (the walk ran in
    the round), SpecTr keeps the host walk and its fp32 logits; T = 0 keeps the argmax walk."""
    from neutrain.speculative import generate
    from neutrain.speculative.generate import _ROUNDS
    from tests.unit.speculative.test_generate_engine import tiny_llama

    target, draft = tiny_llama(0, sharpen=3.0), tiny_llama(1, layers=1, hidden=32, sharpen=3.0)
    prompt = torch.tensor([[4, 9, 33, 2]])
    for scheme, k, temperature, on_device in [("specinfer", 2, 1.0, True), ("sd", 1, 0.7, True),
                                              ("spectr", 2, 1.0, False), ("specinfer", 2, 0.0, False)]:
        out = generate(target, draft, prompt, num_drafts=k, draft_len=3, scheme=scheme, temperature=temperature,
                       max_new_tokens=12, generator=torch.Generator().manual_seed(0), engine=True)
        rounds = _ROUNDS[target]
        assert rounds.walk_on_device == on_device, scheme
        packed = rounds._packed[rounds.mode]
        assert (packed.numel() == 3 + 5 and packed.dtype == torch.long) == on_device
        assert out.sequences.shape == (1, 16) and out.stats.committed_tokens >= 12
        assert out.stats.verified_positions >= out.stats.target_calls and out.stats.accepted_positions >= 0


_HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def test_a_device_walk_round_reads_no_value_on_the_host(monkeypatch):
    """CPU stand-in for the sync-debug GPU test: the round body (surgery, draft, verify, walk, pack) reads
    no tensor value on the host, so it can be captured in one graph and needs no synchronisation."""
    from neutrain.speculative.rounds import EngineRounds, rounds_room
    from tests.unit.speculative.test_generate_engine import tiny_llama

    target, draft = tiny_llama(0, sharpen=3.0), tiny_llama(1, layers=1, hidden=32, sharpen=3.0)
    rounds = EngineRounds(target, [draft], 2, 3, rounds_room(4, 30, 2, 3))
    rounds.start(torch.tensor([[4, 9, 33, 2]]), 1.0, 1.0, seed=0, walk_on_device=True)
    first = rounds.run_walk()  # the first round may initialise lazily
    reads = []

    def guard(name):
        real = getattr(torch.Tensor, name)

        def read(self, *a, **k):
            reads.append(name)
            return real(self, *a, **k)
        return read

    for name in _HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, guard(name))
    for _ in range(3):
        rounds.launch()
    monkeypatch.undo()
    assert reads == [], reads
    walked = rounds.fetch().tolist()
    count = walked[4]
    assert 1 <= count <= 4 and first[4] >= 1
    assert rounds.result.tolist() == [walked[5], count - 1, walked[count - 1]]  # the next surgery's input
