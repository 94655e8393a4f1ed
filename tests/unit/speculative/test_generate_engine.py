"""Speculative generate with ``engine=True``: device-resident rounds give the same exact decoding.

The ``DynamicCache`` path is checked exactly in ``test_generate.py`` (MarkovLM enumeration and
chi-square; its greedy and EOS tests run both paths). The engine path (:mod:`neutrain.speculative.rounds`:
K fixed chains verified over a column mask, the accepted chain moved in place from device-side
numbers, padded draft feeds, drafts sampled on the device) draws its drafts with the engines'
own generators, so here it must follow the target's sequence law (chi-square) for every scheme on
its own, reproduce a seed, and accept every token when the target drafts for itself.
"""

import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from neutrain.speculative import generate
from tests.unit.speculative.test_generate import chi_square, chi_square_threshold


def tiny_llama(seed, layers=2, hidden=64, vocab=48, sharpen=1.0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None,
        bos_token_id=None, pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():  # tiny random models are near uniform; sharpen so target and draft differ
        model.lm_head.weight.mul_(sharpen)
    return model


CONFIGS = [  # (draft models, K, scheme, target temperature, draft temperature)
    (1, 1, "sd", 1.0, 1.0),
    (1, 2, "specinfer", 1.0, 1.0),
    (1, 3, "spectr", 1.0, 1.0),
    (1, 2, "importance", 0.8, 1.3),
    (1, 3, "importance", 1.0, 1.0),
    (2, 2, "specinfer", 1.0, 1.0),
]


def _models(n_drafts, vocab=48, sharpen=1.0):
    target = tiny_llama(0, vocab=vocab, sharpen=sharpen)
    drafts = [tiny_llama(1 + i, layers=1, hidden=32, vocab=vocab, sharpen=sharpen) for i in range(n_drafts)]
    return target, drafts[0] if n_drafts == 1 else drafts


def _run(target, draft, k, scheme, temp, draft_temp, seed, new=20, draft_len=3):
    return generate(target, draft, torch.tensor([[4, 9, 33, 2]]), num_drafts=k, draft_len=draft_len, scheme=scheme,
                    temperature=temp, draft_temperature=draft_temp, max_new_tokens=new,
                    generator=torch.Generator().manual_seed(seed), engine=True)


@pytest.mark.slow
@pytest.mark.parametrize("n_drafts,k,scheme,temp,draft_temp", CONFIGS)
def test_engine_sampling_is_seeded_and_uses_the_drafts(n_drafts, k, scheme, temp, draft_temp):
    target, draft = _models(n_drafts, sharpen=6.0)
    runs = [_run(target, draft, k, scheme, temp, draft_temp, seed) for seed in (0, 0, 1)]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert runs[0].stats.as_dict() == runs[1].stats.as_dict()
    assert not torch.equal(runs[0].sequences, runs[2].sequences)
    for run in runs:
        assert run.sequences.shape == (1, 24) and run.stats.committed_tokens >= 20
        assert run.stats.draft_calls == run.stats.target_calls * 3 * n_drafts
    assert sum(run.stats.accepted_positions for run in runs) > 0  # surgery on accepted paths was exercised


@pytest.mark.parametrize("k,scheme", [(1, "sd"), (2, "specinfer"), (3, "spectr"), (2, "importance")])
def test_engine_target_as_its_own_draft_accepts_everything(k, scheme):
    """Full chains every round: the target keeps all ``draft_len`` moved columns, the draft re-reads
    a full padded feed (``draft_len + 1`` tokens); a wrong column or position would reject a token."""
    target = tiny_llama(0, sharpen=3.0)
    out = _run(target, target, k, scheme, 1.0, 1.0, seed=3, new=24, draft_len=3)
    assert out.stats.acceptance == 1.0 and out.stats.block_efficiency == 4.0


def _sequence_probs(model, prompt, steps, temperature):
    vocab = model.config.vocab_size
    conts = list(itertools.product(range(vocab), repeat=steps))
    ids = torch.tensor([prompt + list(c) for c in conts])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.double() / temperature, -1)
    n = len(prompt)
    out = {}
    for row, cont in enumerate(conts):
        out[cont] = float(sum(logp[row, n - 1 + t, tok] for t, tok in enumerate(cont)).exp())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("n_drafts,k,scheme,temp,draft_temp", CONFIGS)
def test_engine_sequences_follow_the_target_chi_square(n_drafts, k, scheme, temp, draft_temp):
    target, draft = _models(n_drafts, vocab=4, sharpen=30.0)
    prompt, steps, n = [1, 2], 3, 500
    gen = torch.Generator().manual_seed(1234)
    counts, accepted = {}, 0
    for _ in range(n):
        out = generate(target, draft, torch.tensor([prompt]), num_drafts=k, draft_len=2, scheme=scheme,
                       temperature=temp, draft_temperature=draft_temp, max_new_tokens=steps, generator=gen, engine=True)
        key = tuple(out.sequences[0, len(prompt):].tolist())
        counts[key] = counts.get(key, 0) + 1
        accepted += out.stats.accepted_positions
    stat, dof = chi_square(counts, _sequence_probs(target, prompt, steps, temp), n)
    assert stat < chi_square_threshold(dof), (stat, dof)
    assert accepted > 0.2 * n  # the drafts are really used
    first = draft if n_drafts == 1 else draft[0]
    wrong, wrong_dof = chi_square(counts, _sequence_probs(first, prompt, steps, draft_temp), n)
    assert wrong > 3 * chi_square_threshold(wrong_dof)  # the test tells the target's law from the draft's


@pytest.mark.slow
def test_fixed_chain_layout_scores_every_node_like_a_full_forward():
    """Round by round (surgery from the previous walk, padded draft feed, K-chain verify), every
    node's target logits and every drafted token's draft logits equal a full forward of its context."""
    from neutrain.speculative.rounds import EngineRounds, rounds_room

    target, draft = _models(1, sharpen=3.0)
    k, dl = 3, 3
    rounds = EngineRounds(target, [draft], k, dl, rounds_room(4, 30, k, dl))
    seq = [4, 9, 33, 2]
    rounds.start(torch.tensor([seq]), 1.0, 1.0, seed=0)
    outcomes = [(1, 2), (0, 0), (2, 3), (1, 1), (0, 3)]  # (chain, accepted) handed to each next surgery
    for chain, accepted in outcomes:
        tokens, target_logits, draft_logits = rounds.run()
        tokens = tokens.tolist()
        with torch.no_grad():
            for c in range(k):
                full = torch.tensor([seq + tokens[c]])
                expected = target(full).logits[0, len(seq) - 1 :]  # root, then depth 1 .. dl
                got = torch.cat([target_logits[:1], target_logits[1 + c * dl : 1 + (c + 1) * dl]])
                assert torch.allclose(got, expected, atol=1e-4), (c, seq)
                assert torch.allclose(draft_logits[c], draft(full).logits[0, len(seq) - 1 : -1], atol=1e-4)
        new = int(target_logits[1 + chain * dl + accepted - 1].argmax()) if accepted else 5
        rounds.commit(chain, accepted, new)
        seq = seq + tokens[chain][:accepted] + [new]
    assert rounds.finish(len(seq))[0].tolist() == seq
