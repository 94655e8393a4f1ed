"""`neutrain generate`: the prompt goes through the model's chat template (``--raw`` opts out),
and decoding is greedy unless ``--temperature`` says otherwise."""

import pytest
import torch

from neutrain.cli import main
from neutrain.data import byte_tokenizer
from neutrain.data.chat import prompt_ids


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from neutrain.export import export_hf

    tok = byte_tokenizer()
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=tok.eos_token_id,
                                         bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id))
    return export_hf(model, tmp_path_factory.mktemp("gen") / "export", tok)


def _greedy(export_dir, ids: list[int], n: int) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(export_dir).eval(), AutoTokenizer.from_pretrained(export_dir)
    seq = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            nxt = model(seq).logits[0, -1].argmax()
            seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
            if nxt.item() == tok.eos_token_id:
                break
    return tok.decode(seq[0, len(ids):], skip_special_tokens=True)


def _generate(capsys, export_dir, *extra) -> str:
    assert main(["generate", str(export_dir), "--prompt", "def add(a, b):", "--max-new-tokens", "12", *extra]) == 0
    return capsys.readouterr().out.rstrip("\n")


def test_generate_applies_the_chat_template_greedily_and_raw_opts_out(capsys, export_dir):
    tok = byte_tokenizer()
    templated = prompt_ids(tok, "def add(a, b):")
    assert tok.decode(templated).startswith("<|bos|>user\n") and tok.decode(templated).endswith("<|bos|>assistant\n")
    chat = _generate(capsys, export_dir)
    assert chat == _greedy(export_dir, templated, 12)
    assert _generate(capsys, export_dir, "--seed", "7") == chat  # greedy: no seed dependence
    raw = _generate(capsys, export_dir, "--raw")
    assert raw == _greedy(export_dir, tok("def add(a, b):")["input_ids"], 12)
    assert raw != chat


def test_generate_help_states_the_default(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--raw" in out and "0 = greedy (default 0)" in out


def test_plain_generation_runs_in_the_decode_engine(capsys, export_dir, monkeypatch):
    # Without a draft, `neutrain generate` decodes in DecodeEngine (static cache, on-device sampling):
    # greedy equals HF's (above); sampling is reproducible with --seed and moves with it.
    from neutrain.speculative import DecodeEngine

    calls = []
    original = DecodeEngine.generate
    monkeypatch.setattr(DecodeEngine, "generate",
                        lambda self, *a, **k: (calls.append((k, self.fused_groups)), original(self, *a, **k))[1])
    first = _generate(capsys, export_dir, "--temperature", "1.0", "--seed", "3")
    assert _generate(capsys, export_dir, "--temperature", "1.0", "--seed", "3") == first
    others = {_generate(capsys, export_dir, "--temperature", "1.0", "--seed", str(s)) for s in (4, 5, 6)}
    assert len(calls) == 5 and calls[0][0]["temperature"] == 1.0
    # The model is frozen for generation, so each layer's Q/K/V and gate/up run as one GEMV each
    # (greedy still equals HF's, test above): 2 layers x 2 groups.
    assert {fused for _, fused in calls} == {4}
    assert others - {first}, "sampling ignored the seed"


def test_speculative_generation_runs_on_the_decode_engines(capsys, export_dir, monkeypatch):
    # With a draft, the rounds run on DecodeEngines; greedy output still equals the target's.
    import neutrain.speculative as spec

    kwargs = []
    original = spec.generate
    monkeypatch.setattr(spec, "generate", lambda *a, **k: (kwargs.append(k), original(*a, **k))[1])
    out = _generate(capsys, export_dir, "--draft", str(export_dir), "--num-drafts", "2", "--raw")
    assert kwargs and kwargs[0]["engine"] is True
    tok = byte_tokenizer()
    assert out == _greedy(export_dir, prompt_ids(tok, "def add(a, b):", raw=True), 12)
