"""Speculative generate: tree verification, greedy equality and end-to-end exactness.

The Monte-Carlo tests use :class:`MarkovLM` (next token = table of the previous
two tokens, read through the attention mask and the cache), so the exact
probability of every 3-token continuation is a product of table entries.
"""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

from tests.unit.speculative._markov_lm import MarkovLM
from neutrain.speculative import generate
from neutrain.speculative.tree import TokenTree, cache_kwargs, tree_forward


def tiny_llama(seed, layers=2, hidden=64, attn="eager", vocab=48):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


def test_tree_mask_and_positions():
    tree = TokenTree(9)
    assert tree.add_path([1, 2, 3]) == [1, 2, 3]
    assert tree.add_path([1, 4]) == [1, 4]
    assert tree.add_path([5]) == [5]
    mask = tree.attention_mask(2, torch.float32, "cpu")[0, 0]
    allowed = mask == 0
    assert allowed.shape == (6, 8) and allowed[:, :2].all()
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(allowed[:, 2:], expected)
    assert tree.position_ids(2, "cpu").tolist() == [[2, 3, 4, 5, 4, 3]]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_tree_logits_equal_sequential(attn):
    model = tiny_llama(0, attn=attn)
    prefix = [3, 17, 8, 41]
    tree = TokenTree(prefix[-1])
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        tree.add_path(torch.randint(0, 48, (3,), generator=gen).tolist())
    tree.add_path([5, 6, 7])
    tree.add_path([5, 6, 9])  # shared prefix -> branching node
    with torch.no_grad():
        cache = DynamicCache()
        model(input_ids=torch.tensor([prefix[:-1]]), use_cache=True, **cache_kwargs(model, cache))
        logits = tree_forward(model, tree, cache, len(prefix) - 1)
        worst = 0.0
        for node in range(len(tree)):
            path, j = [], node
            while j >= 0:
                path.append(tree.tokens[j])
                j = tree.parents[j]
            full = torch.tensor([prefix[:-1] + path[::-1]])
            worst = max(worst, (model(input_ids=full).logits[0, -1] - logits[node]).abs().max().item())
    assert worst < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("engine", [False, True])  # DynamicCache, or the DecodeEngine's static caches
@pytest.mark.parametrize("k,scheme", [(1, "sd"), (2, "specinfer"), (3, "spectr"), (3, "importance")])
def test_greedy_equals_target_greedy(k, scheme, engine):
    target, draft = tiny_llama(0), tiny_llama(1, layers=1, hidden=32)
    prompt = torch.tensor([[4, 9, 33, 2]])
    with torch.no_grad():
        reference = target.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
    out = generate(target, draft, prompt, num_drafts=k, draft_len=3, scheme=scheme, temperature=0, max_new_tokens=24,
                   engine=engine)
    assert torch.equal(out.sequences, reference)
    # The target as its own draft accepts everything: gamma + 1 tokens per call, cache compaction on full paths.
    out = generate(target, target, prompt, num_drafts=k, draft_len=3, scheme=scheme, temperature=0, max_new_tokens=24,
                   engine=engine)
    assert torch.equal(out.sequences, reference)
    assert out.stats.acceptance == 1.0 and out.stats.block_efficiency == 4.0


def test_sampling_with_target_as_draft_accepts_everything():
    target = tiny_llama(0)
    out = generate(target, target, torch.tensor([[1, 2]]), num_drafts=2, draft_len=3, scheme="importance",
                   temperature=1.0, max_new_tokens=12, generator=torch.Generator().manual_seed(0))
    assert out.stats.acceptance == 1.0 and out.stats.block_efficiency == 4.0
    assert out.sequences.shape == (1, 14)


def chi_square_threshold(dof, z=3.719):  # upper 1e-4 quantile, Wilson-Hilferty
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi_square(counts, probs, n):
    """Pearson statistic with bins of expected count < 5 pooled; returns (stat, dof)."""
    stat, dof, pool_obs, pool_exp = 0.0, -1, 0, 0.0
    for key, prob in probs.items():
        expected = n * prob
        if expected < 5:
            pool_obs, pool_exp = pool_obs + counts.get(key, 0), pool_exp + expected
            continue
        stat += (counts.get(key, 0) - expected) ** 2 / expected
        dof += 1
    if pool_exp > 0:
        stat += (pool_obs - pool_exp) ** 2 / pool_exp
        dof += 1
    return stat, dof


CONFIGS = [  # (drafts, K, scheme, target temperature, draft temperature)
    ("one", 1, "sd", 1.0, 1.0),
    ("one", 2, "specinfer", 1.0, 1.0),
    ("one", 3, "spectr", 1.0, 1.0),
    ("one", 2, "importance", 0.8, 1.3),
    ("one", 3, "importance", 1.0, 1.0),
    ("two_models", 2, "specinfer", 1.0, 1.0),
]


def sample_counts(target, draft, k, scheme, temp, draft_temp, prompt, steps, n):
    gen = torch.Generator().manual_seed(1234)
    counts, accepted = {}, 0
    for _ in range(n):
        out = generate(target, draft, torch.tensor([prompt]), num_drafts=k, draft_len=2, scheme=scheme,
                       temperature=temp, draft_temperature=draft_temp, max_new_tokens=steps, generator=gen)
        key = tuple(out.sequences[0, len(prompt):].tolist())
        counts[key] = counts.get(key, 0) + 1
        accepted += out.stats.accepted_positions
    return counts, accepted


@pytest.mark.slow
@pytest.mark.parametrize("drafts,k,scheme,temp,draft_temp", CONFIGS)
def test_sequences_follow_target_chi_square(drafts, k, scheme, temp, draft_temp):
    vocab, steps, n = 4, 3, 800
    target = MarkovLM(vocab, seed=0)
    draft = MarkovLM(vocab, seed=1, sharpness=1.0) if drafts == "one" else [MarkovLM(vocab, 1, 1.0), MarkovLM(vocab, 2, 1.0)]
    prompt = [1, 2]
    counts, accepted = sample_counts(target, draft, k, scheme, temp, draft_temp, prompt, steps, n)
    stat, dof = chi_square(counts, target.sequence_probs(prompt, steps, temp), n)
    assert stat < chi_square_threshold(dof), (stat, dof)
    assert accepted > 0.2 * n  # the drafts are really used
    # Power: the same samples are far from the draft's own sequence law.
    first_draft = draft if drafts == "one" else draft[0]
    wrong, wrong_dof = chi_square(counts, first_draft.sequence_probs(prompt, steps, draft_temp), n)
    assert wrong > 3 * chi_square_threshold(wrong_dof)


@pytest.mark.slow
def test_chi_square_catches_a_residual_bug(monkeypatch):
    """Power check: drawing rejections from p instead of norm((p - q)^+) must fail the test."""
    import neutrain.speculative.verify as verify

    monkeypatch.setattr(verify, "residual", lambda p, q: p)
    target, draft = MarkovLM(4, seed=0), MarkovLM(4, seed=1, sharpness=1.0)
    counts, _ = sample_counts(target, draft, 1, "sd", 1.0, 1.0, [1, 2], 3, 800)
    stat, dof = chi_square(counts, target.sequence_probs([1, 2], 3), 800)
    assert stat > chi_square_threshold(dof), (stat, dof)


@pytest.mark.slow
@pytest.mark.parametrize("engine", [False, True])
def test_one_token_prompt_and_eos_stop(engine):
    target, draft = tiny_llama(0), tiny_llama(1, layers=1, hidden=32)
    prompt = torch.tensor([[5]])
    with torch.no_grad():
        reference = target.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
    out = generate(target, draft, prompt, num_drafts=2, draft_len=3, temperature=0, max_new_tokens=10, engine=engine)
    assert torch.equal(out.sequences, reference)
    stop = int(reference[0, 4])  # the 4th new token
    first = reference[0, 1:].tolist().index(stop) + 1
    out = generate(target, draft, prompt, num_drafts=2, draft_len=3, temperature=0, max_new_tokens=10, eos_token_id=stop,
                   engine=engine)
    assert torch.equal(out.sequences, reference[:, : first + 1])


def test_generate_argument_errors():
    target, draft = MarkovLM(4, 0), MarkovLM(4, 1)
    prompt = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match="identical drafts"):
        generate(target, [draft, MarkovLM(4, 2)], prompt, scheme="spectr")
    with pytest.raises(ValueError, match="single-draft"):
        generate(target, draft, prompt, num_drafts=2, scheme="sd")
    with pytest.raises(ValueError, match="batch 1"):
        generate(target, draft, torch.tensor([[1, 2], [2, 3]]))


@pytest.mark.gpu
def test_cpu_generator_with_models_on_gpu():
    """The CLI and the recipe's distill step seed a CPU generator; models on a GPU must still sample."""
    target, draft = tiny_llama(0).cuda(), tiny_llama(1).cuda()
    prompt = torch.tensor([[1, 2, 3]], device="cuda")
    runs = [generate(target, draft, prompt, num_drafts=2, draft_len=3, scheme="specinfer", temperature=1.0,
                     max_new_tokens=12, generator=torch.Generator().manual_seed(5)).sequences for _ in range(2)]
    assert runs[0].shape == (1, 15) and torch.equal(runs[0], runs[1])  # seeded: reproducible


def test_generator_on_the_models_device_is_used_as_is():
    from neutrain.speculative.generate import _generator_on

    gen = torch.Generator().manual_seed(0)
    assert _generator_on(gen, torch.device("cpu")) is gen and _generator_on(None, torch.device("cpu")) is None
