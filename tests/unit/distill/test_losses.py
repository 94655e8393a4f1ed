"""Distillation divergences and acceptance rate against brute-force float64 loops."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from neutrain.distill.losses import acceptance_rate, token_acceptance, token_divergence


def brute(p_row, q_row, kind, beta=0.5):
    p, q = [float(x) for x in p_row], [float(x) for x in q_row]
    kl = lambda a, b: sum(x * math.log(x / y) for x, y in zip(a, b) if x > 0)  # noqa: E731
    if kind == "fkl":
        return kl(p, q)
    if kind == "rkl":
        return kl(q, p)
    if kind == "tvd":
        return 0.5 * sum(abs(x - y) for x, y in zip(p, q))
    m = [beta * x + (1 - beta) * y for x, y in zip(p, q)]
    return beta * kl(p, m) + (1 - beta) * kl(q, m)


@pytest.mark.parametrize("kind", ["fkl", "rkl", "tvd", "jsd"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_divergence_matches_brute_force_with_mask(kind, temperature):
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(2, 5, 7, generator=gen, dtype=torch.float64) * 2
    draft = torch.randn(2, 5, 7, generator=gen, dtype=torch.float64) * 2
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]])
    got = token_divergence(target, draft, kind, mask, temperature, beta=0.3)
    values = []
    for b in range(2):
        for t in range(5):
            if mask[b, t]:
                p = torch.softmax(target[b, t] / temperature, -1)
                q = torch.softmax(draft[b, t] / temperature, -1)
                values.append(brute(p, q, kind, beta=0.3))
    assert abs(float(got) - sum(values) / len(values)) < 1e-10
    assert float(token_divergence(target, target, kind, mask, temperature, beta=0.3)) < 1e-12


def test_divergence_gradients_flow_into_draft_only():
    target = torch.randn(3, 6)
    draft = torch.randn(3, 6, requires_grad=True)
    for kind in ("fkl", "rkl", "tvd", "jsd"):
        draft.grad = None
        token_divergence(target, draft, kind).backward()
        assert draft.grad is not None and draft.grad.abs().sum() > 0


def test_acceptance_is_one_minus_tv_and_greedy_agreement():
    gen = torch.Generator().manual_seed(1)
    target, draft = torch.randn(4, 9, generator=gen), torch.randn(4, 9, generator=gen)
    tv = token_divergence(target.double(), draft.double(), "tvd")
    assert abs(float(token_acceptance(target.double(), draft.double())) - (1 - float(tv))) < 1e-6
    draft_same_argmax = draft.clone()
    draft_same_argmax[:2] = target[:2]
    expected = (target.argmax(-1) == draft_same_argmax.argmax(-1)).float().mean()
    assert float(token_acceptance(target, draft_same_argmax, temperature=0)) == float(expected)


def test_acceptance_rate_of_models():
    def tiny(seed):
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=2)
        return AutoModelForCausalLM.from_config(cfg).eval()

    target, draft = tiny(0), tiny(1)
    ids = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    alpha = acceptance_rate(target, draft, [{"input_ids": ids, "attention_mask": mask}])
    with torch.no_grad():
        p = torch.softmax(target(input_ids=ids, attention_mask=mask).logits.double(), -1)
        q = torch.softmax(draft(input_ids=ids, attention_mask=mask).logits.double(), -1)
    per = torch.minimum(p, q).sum(-1)
    expected = float(per[mask.bool()].mean())
    assert abs(alpha - expected) < 1e-5
    assert acceptance_rate(target, target, [{"input_ids": ids}]) == pytest.approx(1.0, abs=1e-5)
