"""memory.offload_weights through NeuTrainer on CPU: same weights as without it, exact resume, export, refusals."""

from pathlib import Path

import pytest
import torch

from neutrain.cli.train import build_trainer
from neutrain.config import RecipeError, load_recipe
from neutrain.nn import decompressed_state_dict
from neutrain.nn.weight_offload_model import weight_store
from tests.helpers import write_recipe

MEMORY = {"weights": "neuzip-lossless", "stochastic_rounding": False, "clip_mode": "per_tensor",
          "gradient_checkpointing": True}


def _recipe(tmp_path, offload, optimizer="adalomo", **train):
    return load_recipe(write_recipe(
        tmp_path, model={"dtype": "bfloat16"}, memory={**MEMORY, "offload_weights": offload},
        train={"optimizer": optimizer, "learning_rate": 5e-2, "max_steps": 4, "save_steps": 2, "max_grad_norm": 1.0,
               "lr_scheduler": "constant", "warmup_steps": 0, **train},
        eval={"perplexity": False}, export={"format": "none"},
    ))


def test_offloaded_recipe_trains_resumes_and_exports_like_the_plain_one(tmp_path):
    from neutrain.export import export_hf

    plain = build_trainer(_recipe(tmp_path / "plain", offload=False))
    plain.trainer.train()
    recipe = _recipe(tmp_path / "offload", offload=True)
    ctx = build_trainer(recipe)
    store = weight_store(ctx.trainer.model)
    assert store is not None and len(store.layers) == 2 and store.host_bytes > 0
    ctx.trainer.train()
    assert store.stats.writebacks > 0
    expected = decompressed_state_dict(plain.trainer.model)
    after = decompressed_state_dict(ctx.trainer.model)
    assert expected.keys() == after.keys() and all(torch.equal(expected[k], after[k]) for k in expected)

    # Resume from checkpoint-2 (saved from the host store) into a fresh offloaded trainer: the same weights.
    ctx2 = build_trainer(recipe)
    ctx2.trainer.train(resume_from_checkpoint=str(Path(recipe.train.output_dir) / "checkpoint-2"))
    resumed = decompressed_state_dict(ctx2.trainer.model)
    assert all(torch.equal(after[k], resumed[k]) for k in after)

    # The exported dense model is the trained one.
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(export_hf(ctx.trainer.model, tmp_path / "export"))
    for k, v in dense.state_dict().items():
        assert torch.equal(v, after[k]), k


@pytest.mark.parametrize("memory,train,message", [
    ({"weights": "dense"}, {}, r"memory\.offload_weights: needs memory\.weights: neuzip-lossless"),
    ({}, {"optimizer": "adamw"}, r"memory\.offload_weights: needs a fused optimizer"),
    ({}, {"gradient_accumulation_steps": 2}, r"memory\.offload_weights: train\.gradient_accumulation_steps must be 1"),
])
def test_offload_weights_refuses_what_it_cannot_compose_with(tmp_path, memory, train, message):
    path = write_recipe(tmp_path, model={"dtype": "bfloat16"}, memory={**MEMORY, "offload_weights": True, **memory},
                        train={"optimizer": "lomo", **train})
    with pytest.raises(RecipeError, match=message):
        load_recipe(path)


def test_offloaded_lomo_resume_writes_the_checkpoint_of_the_uninterrupted_run(tmp_path):
    """The 8B recipe's update scaled down (LOMO, per-tensor clip, no stochastic rounding, weights and
    checkpointed inputs offloaded, embedding rows the tokenizer never produces): 6 steps saving at 4 and 6,
    then a resume 4 -> 6 writes checkpoint-6 again; both files hold the same bytes, tensor by tensor."""
    from safetensors import safe_open

    from tests.helpers import TINY_LLAMA

    config = dict(TINY_LLAMA, hidden_size=64, intermediate_size=128, vocab_size=1024)  # the byte tokenizer: 259
    recipe = load_recipe(write_recipe(
        tmp_path, model={"dtype": "bfloat16", "config": config},
        memory={**MEMORY, "offload_weights": True, "offload_activations": True},
        train={"optimizer": "lomo", "learning_rate": 1e-3, "max_steps": 6, "save_steps": 4, "max_grad_norm": 1.0,
               "lr_scheduler": "constant", "warmup_steps": 0, "micro_batch_size": 2},
        eval={"perplexity": False}, export={"format": "none"},
    ))
    out = Path(recipe.train.output_dir)
    build_trainer(recipe).trainer.train()

    def blobs(path):
        with safe_open(str(path / "model.safetensors"), "pt") as fh:
            return {k: fh.get_tensor(k) for k in fh.keys()}

    uninterrupted = blobs(out / "checkpoint-6")
    build_trainer(recipe).trainer.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    resumed = blobs(out / "checkpoint-6")
    assert uninterrupted.keys() == resumed.keys() and len(uninterrupted) > 100
    assert [k for k in uninterrupted if not torch.equal(uninterrupted[k], resumed[k])] == []
