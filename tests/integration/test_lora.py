"""LoRA adapters on a frozen NeuZip base (lossless and lossy): training, saving, loading, merging."""

import copy
import json
from pathlib import Path

import pytest
import torch

from neutrain.export.lora import merge_lora
from neutrain.nn.lora import apply_lora, compress_model_for_adapters, load_adapters
from tests.helpers import write_recipe

FAST = {"steps": 8}  # short lanes: the CPU reference decoder's cost grows with steps


def _tiny(dtype=torch.float32):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def _train_adapters(peft_model, ids, steps):
    """AdamW over the adapter parameters on one fixed batch; returns the losses."""
    from neutrain.nn import causal_lm_loss

    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=2e-2)
    losses = []
    for _ in range(steps):
        loss = causal_lm_loss(peft_model, ids, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _base_bits(model):
    from neutrain.nn import compressed_weights

    return {w.name: w.dense().clone() for w in compressed_weights(model)}


@pytest.mark.parametrize("weights", ["neuzip-lossless", "neuzip-lossy-3"])
def test_lora_trains_on_frozen_compressed_base_saves_loads_and_merges(tmp_path, weights):
    from neutrain.nn import CompressedLinear, compressed_weights

    model = compress_model_for_adapters(_tiny(), weights, codec_options=FAST)
    lossy = weights != "neuzip-lossless"
    assert all(w.ct.layout.lossless != lossy and not w.trainable for w in compressed_weights(model))
    base = _base_bits(model)
    peft_model = apply_lora(model, {"lora_r": 4, "lora_alpha": 8, "lora_target_modules": "all-linear"})
    layer = peft_model.base_model.model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj.get_base_layer(), CompressedLinear)
    assert isinstance(peft_model.base_model.model.lm_head, CompressedLinear)  # the head is no LoRA target
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    assert trainable and all(p.numel() for p in trainable)

    ids = torch.randint(0, 64, (4, 16))
    losses = _train_adapters(peft_model, ids, 8)
    assert losses[-1] < losses[0] - 0.05, losses
    after = _base_bits(peft_model.get_base_model())
    assert base.keys() == after.keys() and all(torch.equal(base[k], after[k]) for k in base)  # base untouched

    peft_model.eval()
    with torch.no_grad():
        ref = peft_model(ids).logits
    peft_model.save_pretrained(str(tmp_path / "adapters"))
    assert (tmp_path / "adapters" / "adapter_model.safetensors").exists()
    # A fresh base of the same bytes with the saved adapters gives the same logits.
    fresh = copy.deepcopy(peft_model.get_base_model())
    fresh = merge_lora_free_base(fresh)
    reloaded = load_adapters(fresh, tmp_path / "adapters").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, ref)

    if weights == "neuzip-lossless":
        # The CLI merges an adapter checkpoint into a given base (here the bit-identical dense base).
        from transformers import AutoModelForCausalLM

        from neutrain.cli import main
        from neutrain.export import export_hf

        export_hf(merge_lora_free_base(copy.deepcopy(peft_model.get_base_model())), tmp_path / "base")
        assert main(["export", str(tmp_path / "adapters"), "--base", str(tmp_path / "base"), "--format", "hf",
                     "--output", str(tmp_path / "merged")]) == 0
        with torch.no_grad():
            cli_out = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))(ids).logits
        assert (cli_out - ref).abs().max() < 1e-4

    merged_weights = {}
    for target in ("dense", "neuzip-lossless", "neuzip-lossy-7"):
        merged = merge_lora(copy.deepcopy(peft_model), target, codec_options=FAST)
        layer = merged.model.layers[1].mlp.down_proj
        assert isinstance(layer, torch.nn.Linear if target == "dense" else CompressedLinear)
        assert not hasattr(merged, "peft_config") and not any("lora" in n for n, _ in merged.named_modules())
        merged_weights[target] = layer.weight.detach()
        with torch.no_grad():
            out = merged(ids).logits
        # fp32 model: the merge rounds once; lossy-7 keeps 7 of fp32's 23 mantissa bits.
        assert (out - ref).abs().max() < (1e-4 if target != "neuzip-lossy-7" else 2e-2), target
    assert torch.equal(merged_weights["neuzip-lossless"], merged_weights["dense"])
    from neutrain.compress import compress

    assert torch.equal(merged_weights["neuzip-lossy-7"], compress(merged_weights["dense"], 7).decompress())


def merge_lora_free_base(model):
    """The base model without any LoRA layer (what a new process would rebuild from the compressed base)."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            model.set_submodule(name, module.get_base_layer())
    del model.peft_config
    return model


def test_lora_recipe_trains_through_neutrainer_and_exports_merged(tmp_path):
    from transformers import AutoModelForCausalLM

    from neutrain.config import load_recipe
    from neutrain.cli.train import train_from_recipe

    recipe = load_recipe(write_recipe(
        tmp_path, model={"dtype": "float32"},
        memory={"weights": "neuzip-lossy-3", "adapter": "lora", "lora_r": 4, "lora_alpha": 8},
        train={"optimizer": "adamw", "learning_rate": 2e-2, "max_steps": 4, "save_steps": 2, "lr_scheduler": "constant",
               "warmup_steps": 0},
        eval={"perplexity": False}, export={"format": "neuzip"},
    ))
    summary = train_from_recipe(recipe, echo=lambda s: None)
    assert summary["steps"] == 4 and summary["loss_last"] < summary["loss_first"]
    ckpt = Path(recipe.train.output_dir) / "checkpoint-4"
    assert (ckpt / "adapter_model.safetensors").exists() and (ckpt / "adapter_config.json").exists()
    assert not (ckpt / "model.safetensors").exists()  # adapters only: the base is frozen
    export = Path(summary["export_dir"])
    assert json.loads((export / "config.json").read_text())["quantization_config"]["quant_method"] == "neuzip"
    merged = AutoModelForCausalLM.from_pretrained(str(export))
    assert not any("lora" in n for n, _ in merged.named_modules())
    ids = torch.randint(0, merged.config.vocab_size, (1, 6))
    assert merged.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 9)
    # A random-init base has no directory: the run wrote it beside the checkpoints, so `neutrain export` of an
    # adapter checkpoint works (before: "base model directory is unknown or missing (None)").
    from neutrain.cli import main

    assert (Path(recipe.train.output_dir) / "base" / "config.json").exists()
    assert main(["export", str(ckpt), "--format", "hf", "--output", str(tmp_path / "cli-export")]) == 0
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "cli-export"), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits.float(), merged(ids).logits.float(), rtol=1e-3, atol=1e-3)


def test_lora_with_a_fused_optimizer_is_refused(tmp_path):
    from neutrain.config import load_recipe
    from neutrain.errors import RecipeError

    with pytest.raises(RecipeError, match=r"train\.optimizer: LoRA adapters train with adamw or sgd"):
        load_recipe(write_recipe(tmp_path, memory={"weights": "neuzip-lossless", "adapter": "lora"},
                                 train={"optimizer": "lomo"}))


@pytest.mark.gpu
def test_lora_on_a_lossy_base_on_the_gpu_uses_the_decode_kernel():
    from neutrain.kernels.codec import COUNTERS

    model = compress_model_for_adapters(_tiny(torch.bfloat16).cuda(), "neuzip-lossy-3")
    base = _base_bits(model)
    peft_model = apply_lora(model, {"lora_r": 8, "lora_alpha": 16})
    ids = torch.randint(0, 64, (4, 32), device="cuda")
    decodes = COUNTERS["decode"]
    losses = _train_adapters(peft_model, ids, 10)
    assert COUNTERS["decode"] > decodes  # the Triton decoder ran
    assert losses[-1] < losses[0] - 0.05, losses
    assert all(torch.equal(base[k], v) for k, v in _base_bits(peft_model.get_base_model()).items())
    peft_model.eval()
    with torch.no_grad():
        ref = peft_model(ids).logits.float()
        merged = merge_lora(peft_model, "neuzip-lossless")
        out = merged(ids).logits.float()
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()  # bf16: the merged weight is rounded once


def test_neutrain_eval_of_a_lora_run_evaluates_its_adapters_on_its_base(tmp_path, capsys):
    """Before: `neutrain eval recipes/lora_neuzip.yaml` failed: "checkpoint-30 has no config.json"."""
    from neutrain.cli import main

    out = tmp_path / "lora"
    overrides = [f"train.output_dir={out}", "train.max_steps=2", "train.save_steps=2", "data.sequence_len=64",
                 "data.datasets=[{path: python-stdlib, type: text, max_files: 6}]", "model.tokenizer_vocab_size=300",
                 "eval.max_eval_samples=4", "export.format=none"]
    assert main(["train", "recipes/lora_neuzip.yaml", *overrides]) == 0
    heldout = json.loads((out / "summary.json").read_text())["heldout_loss"]
    capsys.readouterr()
    assert main(["eval", "recipes/lora_neuzip.yaml", *overrides]) == 0, capsys.readouterr().err
    results = json.loads((out / "eval" / "eval_results.json").read_text())
    assert results["checkpoint"] == str(out / "checkpoint-2")
    # The adapters on the frozen base the run wrote: the run's own held-out loss (same rows, same bf16 weights).
    assert results["heldout_loss"] == pytest.approx(heldout, rel=1e-3), (results, heldout)
    assert "held-out loss" in capsys.readouterr().out
