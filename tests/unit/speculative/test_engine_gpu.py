"""Speculative rounds on the GPU: graph-replayed, one host synchronisation per round, still exact.

Run on the device machine (``-m gpu``). The CPU tests run the same round body eagerly
(``test_generate_engine.py``, ``test_generate.py``).
"""

import contextlib
import sys

import pytest
import torch

from neutrain.speculative import generate
from neutrain.speculative import rounds as rounds_module
from neutrain.speculative.device_walk import DEVICE_SCHEMES
from tests.unit.speculative.test_generate import chi_square, chi_square_threshold
from tests.unit.speculative.test_generate_engine import _sequence_probs, tiny_llama

pytestmark = pytest.mark.gpu


def _generate_module():
    # ``neutrain.speculative.generate`` is also the function's name in the package: take the module itself.
    return sys.modules["neutrain.speculative.generate"]


def _cuda_models(dtype, vocab=48, sharpen=1.0, n_drafts=1):
    target = tiny_llama(0, vocab=vocab, sharpen=sharpen).to("cuda", dtype)
    drafts = [tiny_llama(1 + i, layers=1, hidden=32, vocab=vocab, sharpen=sharpen).to("cuda", dtype)
              for i in range(n_drafts)]
    return target, drafts[0] if n_drafts == 1 else drafts


@pytest.mark.parametrize("temperature,k,scheme", [(0.0, 2, "specinfer"), (1.0, 1, "sd"), (1.0, 2, "specinfer"),
                                                   (1.0, 2, "importance")])
def test_one_host_synchronisation_per_round(temperature, k, scheme):
    target, draft = _cuda_models(torch.bfloat16, sharpen=4.0)
    prompt = torch.tensor([[4, 9, 33, 2, 17]], device="cuda")
    kw = {"num_drafts": k, "draft_len": 3, "scheme": scheme, "temperature": temperature, "max_new_tokens": 40, "engine": True}
    generate(target, draft, prompt, generator=torch.Generator().manual_seed(0), **kw)  # warm-up: captures the graph
    rounds = _generate_module()._ROUNDS[target]
    assert rounds.use_graph and rounds._graphs
    state = {"allowed": 0}
    original = rounds_module.allowed_sync

    @contextlib.contextmanager
    def counting():
        state["allowed"] += 1
        with original():
            yield

    rounds_module.allowed_sync = counting
    transfers = rounds.transfers
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            rounds.n.item()  # the mode is on: an unannounced synchronisation fails
        out = generate(target, draft, prompt, generator=torch.Generator().manual_seed(1), **kw)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        rounds_module.allowed_sync = original
    assert _generate_module()._ROUNDS[target] is rounds  # the captured graphs were replayed, not rebuilt
    calls = out.stats.target_calls
    assert calls >= 1 and out.stats.committed_tokens >= 40
    assert state["allowed"] == calls  # exactly one allowed synchronisation per round, none elsewhere
    assert rounds.transfers - transfers == calls
    assert out.sequences.shape == (1, 45)


@pytest.mark.parametrize("k,scheme", [(1, "sd"), (2, "specinfer"), (2, "spectr"), (3, "importance")])
def test_graph_replayed_greedy_equals_hf_greedy(k, scheme):
    torch.backends.cuda.matmul.allow_tf32 = False
    target, draft = _cuda_models(torch.float32)
    built = None
    for prompt in ([[7, 1, 30, 12, 5, 5]], [[4, 9, 33, 2]]):  # the second call replays the same graphs
        prompt = torch.tensor(prompt, device="cuda")
        with torch.no_grad():
            reference = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=30,
                                        do_sample=False, pad_token_id=0)
        out = generate(target, draft, prompt, num_drafts=k, draft_len=3, scheme=scheme, temperature=0,
                       max_new_tokens=30, engine=True)
        assert torch.equal(out.sequences, reference)
        rounds = _generate_module()._ROUNDS[target]
        assert rounds.use_graph and list(rounds._graphs) == [(True, False)]  # one graph: greedy, host walk
        built = rounds if built is None else built
        assert rounds is built


@pytest.mark.parametrize("k,scheme", [(2, "importance"), (1, "sd"), (2, "specinfer"), (2, "spectr")])  # sd/specinfer: device walk
def test_graph_replayed_sampling_follows_the_target_and_is_seeded(k, scheme):
    target, draft = _cuda_models(torch.float32, vocab=4, sharpen=30.0)
    prompt, steps, n = [1, 2], 3, 400
    kw = {"num_drafts": k, "draft_len": 2, "scheme": scheme, "temperature": 1.0, "max_new_tokens": steps, "engine": True}
    ids = torch.tensor([prompt], device="cuda")
    runs = [generate(target, draft, ids, generator=torch.Generator().manual_seed(s), **kw).sequences for s in (5, 5)]
    assert torch.equal(runs[0], runs[1])
    gen = torch.Generator().manual_seed(1234)
    counts, accepted = {}, 0
    for _ in range(n):
        out = generate(target, draft, ids, generator=gen, **kw)
        key = tuple(out.sequences[0, len(prompt):].tolist())
        counts[key] = counts.get(key, 0) + 1
        accepted += out.stats.accepted_positions
    assert _generate_module()._ROUNDS[target].walk_on_device == (scheme in DEVICE_SCHEMES)
    cpu_target = target.float().cpu()
    stat, dof = chi_square(counts, _sequence_probs(cpu_target, prompt, steps, 1.0), n)
    assert stat < chi_square_threshold(dof), (stat, dof)
    assert accepted > 0.2 * n
