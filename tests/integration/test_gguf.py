"""GGUF checkpoints: a recipe's ``model.gguf_file`` loads dequantized, compresses, fine-tunes, exports.

The GGUF files are made here with the ``gguf`` package's writer (tests/gguf_writer.py) from a random
tiny Llama, laid out as llama.cpp's converter writes them (permuted Q/K rows, a gpt2-type BPE
vocabulary with merges, special token ids and a chat template).
"""

import json

import pytest
import torch

pytest.importorskip("gguf")

from neutrain.config import load_recipe  # noqa: E402
from neutrain.trainer.modeling import build_model, build_tokenizer, config_only  # noqa: E402
from tests.gguf_writer import tiny_llama, tiny_tokenizer, write_gguf  # noqa: E402
from tests.helpers import write_recipe  # noqa: E402


@pytest.fixture(scope="module")
def base():
    tok = tiny_tokenizer()
    return tok, tiny_llama(len(tok))


def _gguf_recipe(tmp_path, gguf_path, **sections):
    model = {"init": "pretrained", "gguf_file": str(gguf_path), "tokenizer": None, "config": None, "dtype": "float32"}
    return load_recipe(write_recipe(tmp_path, model={**model, **sections.pop("model", {})}, **sections))


@pytest.mark.parametrize("weights", ["dense", "neuzip-lossless"])
def test_gguf_loads_as_the_model_it_was_written_from(tmp_path, base, weights):
    from neutrain.nn import CompressedLinear

    tok, ref = base
    path = write_gguf(tmp_path / "tiny-f32.gguf", ref, tok, "F32")
    recipe = _gguf_recipe(tmp_path, path)
    assert config_only(recipe.model).hidden_size == 64  # what `neutrain estimate` plans with
    tokenizer = build_tokenizer(recipe.model, recipe.data, recipe.train.output_dir, str(tmp_path))
    # The tokenizer the file carries: same ids, its special tokens and chat template.
    assert tokenizer("def add(a, b):")["input_ids"] == tok("def add(a, b):")["input_ids"]
    assert (tokenizer.eos_token, tokenizer.bos_token, tokenizer.pad_token) == ("<|eos|>", "<|bos|>", "<|pad|>")
    assert tokenizer.chat_template == tok.chat_template
    model = build_model(recipe.model, tokenizer, use_cpu=True, weights=weights)
    assert isinstance(model.model.layers[0].self_attn.q_proj, CompressedLinear) == (weights != "dense")
    ids = torch.randint(0, len(tok), (2, 11))
    with torch.no_grad():  # F32 tensors, Q/K permutation undone: the very same function
        assert torch.equal(model.eval()(ids).logits, ref(ids).logits)


def test_quantized_gguf_is_dequantized_as_gguf_does(tmp_path, base):
    import gguf
    import numpy as np

    from neutrain.nn import CompressedLinear

    tok, ref = base
    path = write_gguf(tmp_path / "tiny-q8_0.gguf", ref, tok, "Q8_0")
    recipe = _gguf_recipe(tmp_path, path)
    model = build_model(recipe.model, tok, use_cpu=True, weights="neuzip-lossless")
    up = model.model.layers[1].mlp.up_proj
    assert isinstance(up, CompressedLinear)
    stored = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.1.ffn_up.weight")
    expected = gguf.quants.dequantize(np.asarray(stored.data), stored.tensor_type).reshape(up.compressed.shape)
    assert torch.equal(up.weight, torch.from_numpy(np.ascontiguousarray(expected)).float())
    assert not torch.equal(up.weight, ref.model.layers[1].mlp.up_proj.weight)  # it was quantized


def test_gguf_recipe_fine_tunes_exports_in_its_dtype_and_reloads(tmp_path, base):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from neutrain.cli import main

    tok, ref = base
    path = write_gguf(tmp_path / "tiny-bf16.gguf", ref, tok, "BF16")
    rows = [{"messages": [{"role": "user", "content": f"what is {a}+{b}?"}, {"role": "assistant", "content": str(a + b)}]}
            for a in range(6) for b in range(4)]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = write_recipe(
        tmp_path, model={"init": "pretrained", "gguf_file": str(path), "tokenizer": None, "config": None, "dtype": "auto"},
        data={"datasets": [{"path": str(data), "type": "messages"}], "sequence_len": 64, "sample_packing": True},
        train={"optimizer": "adalomo", "learning_rate": 1e-3, "max_steps": 3, "save_steps": 3, "micro_batch_size": 2,
               "lr_scheduler": "constant", "warmup_steps": 0},
        memory={"weights": "neuzip-lossless"}, eval={"perplexity": False}, export={"format": "hf"},
    )
    assert main(["train", str(recipe)]) == 0
    export = tmp_path / "out" / "export"
    loaded = AutoModelForCausalLM.from_pretrained(str(export))
    assert loaded.dtype == torch.bfloat16, "the export keeps the GGUF's BF16, not the CPU run's fp32 compute dtype"
    exported_tok = AutoTokenizer.from_pretrained(str(export))
    assert exported_tok.chat_template == tok.chat_template and exported_tok.eos_token == "<|eos|>"
    # Trained: the matrices moved away from the (bf16) GGUF weights.
    start = ref.model.layers[0].mlp.down_proj.weight.to(torch.bfloat16)
    assert not torch.equal(loaded.model.layers[0].mlp.down_proj.weight, start)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["loss_last"] > 0
