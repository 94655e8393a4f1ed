"""A recipe's ``model.base_model`` as users hold it: a local directory of sharded bf16 safetensors.

It loads straight into NeuZip form, one tensor at a time (the dense model never exists), and a CPU
run of it (fp32 compute) exports in the base's bf16.
"""

import json
import weakref

import pytest
import torch

from neutrain.config import load_recipe
from neutrain.data import byte_tokenizer
from tests.helpers import TINY_LLAMA, write_recipe


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny Llama saved as bf16 safetensors in several shards (with an index), plus its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path_factory.mktemp("base")
    tok = byte_tokenizer()
    cfg = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    config = AutoConfig.for_model("llama", vocab_size=len(tok), **cfg)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(str(path), max_shard_size="20KB")
    tok.save_pretrained(str(path))
    assert len(list(path.glob("*.safetensors"))) > 2 and (path / "model.safetensors.index.json").exists()
    return path


def _base_recipe(tmp_path, base_dir, **sections):
    model = {"init": "pretrained", "base_model": str(base_dir), "tokenizer": None, "config": None, "dtype": "auto"}
    return write_recipe(tmp_path, model=model, **sections)


def test_sharded_base_streams_into_compressed_form_tensor_by_tensor(tmp_path, base_dir, monkeypatch):
    import transformers
    from transformers import AutoModelForCausalLM

    from neutrain.trainer.modeling import build_model, resolve_dtype
    from neutrain.nn import CompressedLinear
    from neutrain.nn.sources import SafetensorsFolder

    def no_dense_load(*args, **kwargs):
        raise AssertionError("the dense model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_dense_load)
    read, alive_at_read = [], []
    tensors = SafetensorsFolder.tensors

    def watched_tensors(self, model, device, dtype):
        for name, tensor in tensors(self, model, device, dtype):
            # Every matrix read before this one is gone: only its compressed form remains.
            alive_at_read.append([n for n, ref in read if ref() is not None])
            if tensor.dim() == 2:
                read.append((name, weakref.ref(tensor)))
            yield name, tensor
            del tensor

    monkeypatch.setattr(SafetensorsFolder, "tensors", watched_tensors)
    recipe = load_recipe(_base_recipe(tmp_path, base_dir, memory={"weights": "neuzip-lossless"}, train={"optimizer": "adalomo"}))
    model = build_model(recipe.model, byte_tokenizer(), use_cpu=True, weights="neuzip-lossless")
    alive_at_read.append([n for n, ref in read if ref() is not None])  # the last one too
    assert len(read) == 16 and not any(alive_at_read), alive_at_read  # 14 layer matrices, embedding, head
    assert isinstance(model.model.layers[1].mlp.down_proj, CompressedLinear)
    monkeypatch.undo()
    # dtype auto: fp32 over bf16 storage on a CPU without bf16 units (the weights upcast), bf16 where it has them.
    ref = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=resolve_dtype("auto", use_cpu=True))
    ids = torch.randint(0, 259, (2, 13))
    with torch.no_grad():  # bf16 storage, computed in the resolved dtype: the base's function exactly
        assert torch.equal(model.eval()(ids).logits, ref.eval()(ids).logits)


def test_cpu_run_of_a_bf16_base_exports_bf16(tmp_path, base_dir):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from neutrain.cli import main

    recipe = _base_recipe(tmp_path, base_dir, memory={"weights": "neuzip-lossless"},
                          train={"optimizer": "adalomo", "learning_rate": 1e-3, "max_steps": 2, "save_steps": 2},
                          eval={"perplexity": False})
    assert main(["train", str(recipe)]) == 0
    export = tmp_path / "out" / "export"
    assert json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(next(export.glob("*.safetensors"))), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    loaded = AutoModelForCausalLM.from_pretrained(str(export))
    base = AutoModelForCausalLM.from_pretrained(str(base_dir))
    assert loaded.dtype == torch.bfloat16
    assert not torch.equal(loaded.model.layers[0].mlp.up_proj.weight, base.model.layers[0].mlp.up_proj.weight)


def test_a_from_scratch_rate_on_a_pretrained_base_warns_in_one_line(tmp_path, base_dir, caplog):
    # Before: recipes/default.yaml copied with model.base_model set kept AdaLomo's from-scratch 0.1, which wrecks a
    # pretrained model within a few steps, and nothing said so.
    import logging

    from neutrain.cli.train import build_trainer

    recipe = load_recipe(_base_recipe(tmp_path, base_dir, train={"optimizer": "adalomo", "learning_rate": 0.1}))
    with caplog.at_level(logging.WARNING, logger="neutrain"):
        build_trainer(recipe)
    lines = [r.getMessage() for r in caplog.records if "learning_rate" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0].startswith("train.learning_rate: 0.1 is a from-scratch rate for adalomo, and model ")
    assert "fine-tuning with adalomo uses 5e-4 (recipes/smollm2_chat.yaml" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="neutrain"):  # the fine-tuning rate: no warning
        build_trainer(load_recipe(_base_recipe(tmp_path / "ok", base_dir, train={"optimizer": "adalomo", "learning_rate": 5e-4})))
    assert not [r for r in caplog.records if "learning_rate" in r.getMessage()]


def test_the_learning_rate_advice_per_optimizer():
    from neutrain.cli.advice import learning_rate_advice

    assert learning_rate_advice("adamw", 2e-5, "base") is None and learning_rate_advice("adamw", 1e-3, "base")
    assert learning_rate_advice("lomo", 1e-3, "base") is None and learning_rate_advice("lomo", 0.1, "base")
    assert learning_rate_advice("adalomo", 0.1, None) is None  # from scratch: the rate is right
