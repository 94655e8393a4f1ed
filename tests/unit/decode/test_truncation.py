"""Top-k and top-p sampling: the same truncation as transformers' warpers, in the decode engine and the CLI.

Before: ``neutrain generate`` had no ``--top-k`` or ``--top-p`` and sampled the full ``softmax(logits / T)``.
"""

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from neutrain.decode.engine import DecodeEngine, sample_tokens
from neutrain.decode.truncation import truncate


def _warped(scores, temperature, top_k, top_p):
    """transformers' order: temperature, then top-k, then top-p (GenerationMixin._get_logits_processor)."""
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores


@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (5, 1.0), (50, 1.0), (0, 0.5), (0, 0.9), (0, 0.999), (20, 0.8), (3, 0.3)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_truncation_equals_the_transformers_warpers(top_k, top_p, temperature):
    generator = torch.Generator().manual_seed(top_k * 1000 + int(top_p * 100))
    for scale in (0.5, 3.0, 10.0):  # flat to peaked laws
        scores = torch.randn(4, 300, generator=generator) * scale
        expected = _warped(scores.clone(), temperature, top_k, top_p)
        got = truncate(scores / temperature, top_k, top_p)
        assert torch.equal(torch.isinf(got), torch.isinf(expected))
        assert torch.equal(got, expected)


def test_no_truncation_leaves_the_scores():
    scores = torch.randn(2, 50)
    assert torch.equal(truncate(scores, 0, 1.0), scores)
    with pytest.raises(ValueError, match="top_p"):
        DecodeEngine(_tiny(), max_len=16).prefill(torch.tensor([[1, 2]]), temperature=1.0, top_p=0.0)


def test_sampled_tokens_stay_inside_the_truncated_set():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 40, generator=generator)
    temperature = torch.tensor(1.0, dtype=torch.float64)
    allowed_k = set(torch.topk(logits[0], 3).indices.tolist())
    nucleus = ~torch.isinf(truncate(logits.clone(), 0, 0.6))[0]
    seen_k, seen_p = set(), set()
    for _ in range(300):
        seen_k.add(int(sample_tokens(logits, temperature, generator, top_k=3)))
        seen_p.add(int(sample_tokens(logits, temperature, generator, top_p=0.6)))
    assert seen_k == allowed_k  # every kept token is drawn, nothing else
    assert seen_p <= set(torch.nonzero(nucleus).flatten().tolist()) and len(seen_p) > 1


def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)).eval()


@pytest.mark.slow
def test_the_engine_with_top_k_one_decodes_greedily():
    model = _tiny()
    prompt = torch.tensor([[3, 7, 11]])
    greedy = DecodeEngine(model, max_len=24).generate(prompt, 12, temperature=0)
    assert torch.equal(DecodeEngine(model, max_len=24, seed=5).generate(prompt, 12, temperature=1.3, top_k=1), greedy)
    sampled = DecodeEngine(model, max_len=24, seed=5).generate(prompt, 12, temperature=1.3, top_p=0.9)
    assert sampled.shape == greedy.shape


@pytest.mark.slow
def test_generate_takes_top_k_and_top_p(tmp_path, capsys):
    from neutrain.cli import main
    from neutrain.data import byte_tokenizer
    from neutrain.export import export_hf

    tok = byte_tokenizer()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=tok.eos_token_id,
                                         bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id))
    export = export_hf(model, tmp_path / "export", tok)
    base = ["generate", str(export), "--prompt", "x", "--raw", "--max-new-tokens", "8"]
    assert main([*base, "--temperature", "0"]) == 0
    greedy = capsys.readouterr().out.splitlines()[-1]
    assert main([*base, "--temperature", "2.0", "--top-k", "1", "--seed", "3"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == greedy  # top-1 sampling is greedy
    assert main([*base, "--temperature", "1.0", "--top-p", "1.5"]) == 2
    assert "--top-p: 1.5 is out of range" in capsys.readouterr().err
    assert main([*base, "--temperature", "1.0", "--top-k", "-2"]) == 2
    assert "--top-k: -2 is out of range" in capsys.readouterr().err


def test_the_plain_path_passes_top_k_and_top_p_to_transformers(tmp_path, monkeypatch):
    # A model the engine cannot hold (sliding-window layers) decodes through model.generate: the truncation must
    # reach it, and no generation_config default (top_k 50) may stand in for "no top-k".
    import argparse

    import neutrain.decode as decode
    from neutrain.cli.generate import _plain
    from neutrain.data import byte_tokenizer

    def refuse(*a, **k):
        raise ValueError("sliding-window layers")

    monkeypatch.setattr(decode, "DecodeEngine", refuse)  # where generate's plain path finds it
    model, seen = _tiny(), []
    original = model.generate
    monkeypatch.setattr(model, "generate", lambda *a, **k: (seen.append(k), original(*a, **k))[1])
    args = argparse.Namespace(temperature=0.8, top_k=5, top_p=0.9, max_new_tokens=4, seed=0)
    _plain(model, torch.tensor([[3, 7]]), args, byte_tokenizer())
    _plain(model, torch.tensor([[3, 7]]), argparse.Namespace(**{**vars(args), "top_k": 0, "top_p": 1.0}), byte_tokenizer())
    assert [(k["top_k"], k["top_p"], k["do_sample"]) for k in seen] == [(5, 0.9, True), (0, 1.0, True)]
