"""NeuZip-lossless weights + fused updates through NeuTrainer on CPU: train, resume exactly, export."""

import json
from pathlib import Path

import pytest
import torch

from neutrain.trainer.callbacks import read_metrics
from neutrain.config import load_recipe
from neutrain.cli.train import build_trainer
from tests.helpers import write_recipe

COMPRESSED = {"weights": "neuzip-lossless", "stochastic_rounding": True, "clip_mode": "per_tensor"}


def _recipe(tmp_path, optimizer="lomo", **train):
    return load_recipe(write_recipe(
        tmp_path, model={"dtype": "bfloat16"}, memory=COMPRESSED,
        train={"optimizer": optimizer, "learning_rate": 5e-2, "max_steps": 4, "save_steps": 2, "max_grad_norm": 1.0,
               "lr_scheduler": "constant", "warmup_steps": 0, **train},
        eval={"perplexity": False}, export={"format": "none"},
    ))


@pytest.mark.parametrize("optimizer", ["lomo", "adalomo"])
def test_compressed_fused_training_resumes_bit_exactly_and_exports(tmp_path, optimizer):
    from transformers import AutoModelForCausalLM

    from neutrain.export import export_hf
    from neutrain.nn import CompressedLinear, decompressed_state_dict

    recipe = _recipe(tmp_path / "a", optimizer)
    ctx = build_trainer(recipe)
    model = ctx.trainer.model
    assert isinstance(model.lm_head, CompressedLinear) and isinstance(model.model.layers[0].mlp.up_proj, CompressedLinear)
    before = {k: v.clone() for k, v in decompressed_state_dict(model).items()}
    ctx.trainer.train()
    out = Path(recipe.train.output_dir)
    logged = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert len(logged) == 4 and all(r["grad_norm"] > 0 for r in logged), logged
    after = decompressed_state_dict(model)
    changed = sum(int((after[k] != before[k]).sum()) for k in before if k.endswith("proj.weight"))
    total = sum(before[k].numel() for k in before if k.endswith("proj.weight"))
    assert changed > total // 2, f"only {changed}/{total} weights changed"
    assert json.loads((out / "checkpoint-2" / "neutrain_weights.json").read_text())["weights"] == "neuzip-lossless"

    # Held-out evaluation goes through the chunked loss too.
    eval_loss = ctx.trainer.evaluate()["eval_loss"]
    assert 0.0 < eval_loss < 20.0

    # Resume from checkpoint-2 in a fresh trainer: the last two losses and final weights match exactly.
    ctx2 = build_trainer(recipe)
    ctx2.trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    resumed = {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}
    assert [resumed[s] for s in (3, 4)] == [r["loss"] for r in logged[2:]]
    after2 = decompressed_state_dict(ctx2.trainer.model)
    assert all(torch.equal(after[k], after2[k]) for k in after)

    # Export writes dense weights bit-identical to the decoded ones; logits match the compressed model.
    export_dir = export_hf(model, tmp_path / "export")
    dense = AutoModelForCausalLM.from_pretrained(export_dir)
    for k, v in dense.state_dict().items():
        assert torch.equal(v, after[k]), k
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.equal(dense(ids).logits, model.eval()(ids).logits)


def test_lossy_weights_without_adapter_and_adamw_on_compressed_are_refused(tmp_path):
    from neutrain.config import RecipeError

    with pytest.raises(RecipeError, match=r"memory\.weights: neuzip-lossy-3 weights cannot be trained"):
        load_recipe(write_recipe(tmp_path, memory={"weights": "neuzip-lossy-3"}))
    with pytest.raises(RecipeError, match=r"train\.optimizer: compressed weights are updated inside backward"):
        load_recipe(write_recipe(tmp_path, memory={"weights": "neuzip-lossless"}, train={"optimizer": "adamw"}))
