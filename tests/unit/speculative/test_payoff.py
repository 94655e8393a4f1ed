"""A draft must pay: the first rounds are measured, and a draft whose rounds commit fewer tokens than they cost
is dropped, the output unchanged (greedy: the target's own decode).

Before: ``neutrain generate --draft`` with the quick start's draft (acceptance 0.00, 1.00 token per target
call) speculated to the end and took 88 s where plain decoding took 42 s, saying nothing.
"""

from types import SimpleNamespace

import pytest
import torch

from neutrain.speculative import generate
from neutrain.speculative.payoff import PROBE_ROUNDS, Probe, decode_weights, pays, round_cost
from tests.unit.speculative.test_generate_engine import tiny_llama

PROMPT = torch.tensor([[4, 9, 33, 2]])


def _greedy(model, new):
    with torch.no_grad():
        return model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=new, do_sample=False,
                              pad_token_id=0)


def test_round_cost_counts_the_weights_a_token_multiplies():
    target, draft = tiny_llama(0, layers=4, hidden=64), tiny_llama(1, layers=1, hidden=64)
    # 4 layers of q, k, v, o (k and v at 2 of 4 heads) and a gated MLP, then the 48-token head.
    assert decode_weights(target) == 4 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) + 48 * 64
    assert round_cost(target, [draft], draft_len=4) == pytest.approx(1 + 4 * decode_weights(draft) / decode_weights(target))
    assert round_cost(target, [draft, draft], draft_len=2) == pytest.approx(1 + 2 * 2 * decode_weights(draft) / decode_weights(target))
    assert not pays(1.0, 1.5) and pays(2.0, 1.5)


def test_the_probe_decides_once_after_its_rounds():
    probe = Probe(cost=2.0, rounds=3)
    assert probe(SimpleNamespace(target_calls=2, block_efficiency=1.0)) and probe.verdict is None
    assert not probe(SimpleNamespace(target_calls=3, block_efficiency=1.5)) and probe.verdict == "does not pay"
    keeps = Probe(cost=2.0, rounds=3)
    assert keeps(SimpleNamespace(target_calls=3, block_efficiency=2.5)) and keeps.verdict == "pays"
    assert keeps(SimpleNamespace(target_calls=9, block_efficiency=1.0))  # measured once: later rounds do not undo it


@pytest.mark.parametrize("engine", [False, True])
def test_keep_going_stops_the_rounds_and_keeps_every_committed_token(engine):
    target, draft = tiny_llama(0), tiny_llama(7, layers=1, hidden=32)
    res = generate(target, draft, PROMPT, num_drafts=2, draft_len=3, scheme="importance", temperature=0,
                   max_new_tokens=40, engine=engine, keep_going=lambda stats: stats.target_calls < 3)
    assert res.stopped and res.stats.target_calls == 3
    made = res.sequences.shape[1] - PROMPT.shape[1]
    assert 3 <= made < 40
    assert torch.equal(res.sequences, _greedy(target, made))  # greedy: exactly the target's own tokens
    full = generate(target, draft, PROMPT, num_drafts=2, draft_len=3, scheme="importance", temperature=0,
                    max_new_tokens=6, engine=engine, keep_going=lambda stats: True)
    assert not full.stopped and full.sequences.shape[1] == PROMPT.shape[1] + 6


@pytest.mark.slow
def test_a_draft_that_does_not_pay_is_dropped_in_one_line(tmp_path, capsys):
    # A random 1-layer draft of a random target: its first rounds accept next to nothing.
    from neutrain.cli import main
    from neutrain.data import byte_tokenizer
    from neutrain.export import export_hf

    tok = byte_tokenizer()

    def model(seed, layers, hidden):
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        return LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                            eos_token_id=None, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id))

    target = export_hf(model(1, 2, 32), tmp_path / "target", tok)
    draft = export_hf(model(2, 1, 32), tmp_path / "draft", tok)
    args = ["generate", str(target), "--prompt", "def add(a, b):", "--raw", "--max-new-tokens", "48"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--draft", str(draft)]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and plain.endswith(captured.out)  # greedy: the same tokens, the rest decoded plainly (DeepSpeed may log first)
    lines = [line for line in captured.err.splitlines() if "draft" in line]
    assert len(lines) == 1 and lines[0].startswith(f"[draft does not pay: over the first {PROBE_ROUNDS} rounds"), captured.err
    assert "decoding without it]" in lines[0]
