"""NeuZip-trained model -> `neutrain export --format neuzip[-lossy-k]` -> from_pretrained, compressed."""

import json
from pathlib import Path

import pytest
import torch

import neutrain  # noqa: F401  (registers the quantizer)
from neutrain.cli import main
from tests.helpers import write_recipe


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Llama trained 2 steps with NeuZip-lossless weights and LOMO, plus its checkpoint."""
    from neutrain.config import load_recipe
    from neutrain.cli.train import build_trainer

    tmp = tmp_path_factory.mktemp("neuzip_export")
    recipe = load_recipe(write_recipe(
        tmp, model={"dtype": "bfloat16"}, memory={"weights": "neuzip-lossless"},
        train={"optimizer": "lomo", "learning_rate": 5e-2, "max_steps": 2, "save_steps": 2, "lr_scheduler": "constant",
               "warmup_steps": 0},
        eval={"perplexity": False}, export={"format": "none"},
    ))
    ctx = build_trainer(recipe)
    before = {w.name: w.dense() for w in _weights(ctx.trainer.model)}
    ctx.trainer.train()
    changed = [n for n, w in before.items() if not torch.equal(w, _by_name(ctx.trainer.model, n).dense())]
    assert len(changed) > len(before) // 2  # really trained
    return ctx.trainer.model.eval(), Path(recipe.train.output_dir) / "checkpoint-2"


def _weights(model):
    from neutrain.nn import compressed_weights

    return compressed_weights(model)


def _by_name(model, name):
    return next(w for w in _weights(model) if w.name == name)


def test_lossless_export_of_a_trained_checkpoint_loads_compressed_with_the_same_logits(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    from neutrain.nn import CompressedLinear, decompressed_state_dict

    model, ckpt = trained
    out = tmp_path / "nz"
    assert main(["export", str(ckpt), "--format", "neuzip", "--output", str(out)]) == 0
    assert json.loads((out / "neutrain_export.json").read_text())["format"] == "neuzip"
    assert (out / "tokenizer_config.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    assert isinstance(loaded.model.layers[0].mlp.gate_proj, CompressedLinear)
    trained_state, loaded_state = decompressed_state_dict(model), decompressed_state_dict(loaded)
    for name, value in trained_state.items():
        assert torch.equal(loaded_state[name].view(torch.int16), value.view(torch.int16)), name
    ids = torch.randint(0, model.config.vocab_size, (2, 11))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_lossy_export_from_the_cli(trained, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    model, ckpt = trained
    out = tmp_path / "lossy3"
    assert main(["export", str(ckpt), "--format", "neuzip-lossy-3", "--output", str(out)]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    assert loaded.config.quantization_config.mantissa_bits == 3
    ids = torch.randint(0, model.config.vocab_size, (2, 11))
    with torch.no_grad():
        ref, got = model(ids).logits.float(), loaded(ids).logits.float()
    assert not torch.equal(got, ref) and (got - ref).abs().max() < 0.1 * ref.abs().max()
    assert main(["export", str(ckpt), "--format", "neuzip-lossy-2", "--output", str(tmp_path / "bad")]) == 2
    # Refused before anything loads (neutrain.export.check_format), naming the value and the k that exist.
    assert "'neuzip-lossy-2' is not available" in (err := capsys.readouterr().err) and "k = 0, 1, 3 or 7" in err


def test_adapter_checkpoint_without_a_base_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": None, "peft_type": "LORA"}))
    assert main(["export", str(tmp_path), "--format", "hf"]) == 2
    assert "pass --base DIR" in capsys.readouterr().err
