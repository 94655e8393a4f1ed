"""`neutrain generate`: the prompt goes through the model's chat template (``--raw`` opts out),
and decoding is greedy unless ``--temperature`` says otherwise."""

import json

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


def test_generate_compile_on_the_cpu_is_refused_in_one_line(capsys, export_dir):
    # The compiled layers serve a GPU's captured step; on the CPU the flag would compile for nothing (or fail
    # without a C++ compiler), so it is refused, naming the flag, before any decoding.
    assert main(["generate", str(export_dir), "--prompt", "hi", "--max-new-tokens", "4", "--compile"]) != 0
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if "error" in line]
    assert out == "" and len(errors) == 1, err
    assert errors[0].startswith("neutrain: error: --compile: this run decodes on the CPU"), err


def test_generate_compile_with_a_draft_is_refused_as_ignored(capsys, export_dir):
    assert main(["generate", str(export_dir), "--prompt", "hi", "--draft", str(export_dir), "--compile"]) != 0
    err = capsys.readouterr().err
    assert "--compile: the command would ignore it (the speculative rounds decode" in err


def test_generate_help_states_the_default(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--raw" in out and "0 = greedy (default 0)" in out


def test_plain_generation_runs_in_the_decode_engine(capsys, export_dir, monkeypatch):
    # Without a draft, `neutrain generate` decodes in DecodeEngine (static cache, on-device sampling):
    # greedy equals HF's (above); sampling is reproducible with --seed and moves with it.
    from neutrain.decode import DecodeEngine

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


def test_an_input_file_gives_each_prompt_its_own_output_in_order(capsys, export_dir, tmp_path):
    # Before: one prompt per command, the model loaded again for each.
    prompts = ["def add(a, b):", "class Point:", "import os"]
    singles = [_generate_prompt(capsys, export_dir, p) for p in prompts]
    text = tmp_path / "prompts.txt"
    text.write_text("\n".join([prompts[0], "", *prompts[1:]]) + "\n")  # a blank line is no prompt
    assert main(["generate", str(export_dir), "--input-file", str(text), "--max-new-tokens", "12"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["prompt"] for r in rows] == prompts and [r["output"] for r in rows] == singles
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    assert main(["generate", str(export_dir), "--input-file", str(jsonl), "--max-new-tokens", "12"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert rows == [{"id": i, "prompt": p, "output": o} for i, (p, o) in enumerate(zip(prompts, singles))]


def test_a_bad_input_file_is_one_line_before_the_model_loads(capsys, export_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    assert main(["generate", str(export_dir), "--input-file", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line 2: expected a JSON object with a non-empty string \"prompt\" field" in err, err
    assert main(["generate", str(export_dir), "--input-file", str(tmp_path / "absent.txt")]) == 2
    assert "--input-file: " in capsys.readouterr().err


def _generate_prompt(capsys, export_dir, prompt) -> str:
    assert main(["generate", str(export_dir), "--prompt", prompt, "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out[:-1]  # the output and print's newline
    return out.split("\n", 1)[1] if "Setting accelerator to CPU" in out.split("\n", 1)[0] else out


def test_chat_keeps_the_conversation_in_the_template_and_ends_at_eof(capsys, export_dir, monkeypatch):
    # Before: no chat command; each turn a new `generate`, the model loaded again and the conversation lost.
    import io

    import neutrain.cli.chat as chat

    seen = []
    original = chat.decode
    monkeypatch.setattr(chat, "decode", lambda loaded, ids, args, draft=None: (seen.append(ids), original(loaded, ids, args))[1])
    monkeypatch.setattr("sys.stdin", io.StringIO("def add(a, b):\n\nclass Point:\n"))
    assert main(["chat", str(export_dir), "--max-new-tokens", "12", "--system", "be brief"]) == 0
    out, err = capsys.readouterr()
    replies = out.splitlines()[-2:]
    tok = byte_tokenizer()
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]
    assert seen[0].tolist()[0] == prompt_ids(tok, first)
    assert replies[0] == _greedy(export_dir, prompt_ids(tok, first), 12).strip()
    second = [*first, {"role": "assistant", "content": replies[0]}, {"role": "user", "content": "class Point:"}]
    assert len(seen) == 2 and seen[1].tolist()[0] == prompt_ids(tok, second)  # the whole conversation, in the template
    assert "each line is a user turn" in err and "Traceback" not in err


def test_chat_ends_cleanly_on_ctrl_c(capsys, export_dir, monkeypatch):
    class Interrupted:
        def readline(self, limit=-1):
            raise KeyboardInterrupt

        def isatty(self):
            return False

    monkeypatch.setattr("sys.stdin", Interrupted())
    assert main(["chat", str(export_dir)]) == 0
    assert "Traceback" not in capsys.readouterr().err
