"""memory.mlp_chunk_tokens and memory.offload_slots through NeuTrainer on CPU: the MLPs run in chunks, the weight
store has the slots asked for, and the run trains to the weights of the unchunked run (up to the chunks' sums)."""

import torch

from neutrain.cli.train import build_trainer
from neutrain.config import load_recipe
from neutrain.nn import decompressed_state_dict
from neutrain.nn.weight_offload_model import weight_store
from tests.helpers import write_recipe

MEMORY = {"weights": "neuzip-lossless", "stochastic_rounding": False, "clip_mode": "per_tensor",
          "gradient_checkpointing": True, "offload_weights": True}


def _trained(tmp_path, **memory):
    recipe = load_recipe(write_recipe(
        tmp_path, model={"dtype": "bfloat16"}, memory={**MEMORY, **memory},
        train={"optimizer": "lomo", "learning_rate": 1e-3, "max_steps": 2, "save_steps": 100, "max_grad_norm": 1.0,
               "lr_scheduler": "constant", "warmup_steps": 0},
        eval={"perplexity": False}, export={"format": "none"},
    ))
    ctx = build_trainer(recipe)
    ctx.trainer.train()
    return ctx.trainer.model, weight_store(ctx.trainer.model)


def test_chunked_recipe_trains_like_the_unchunked_one(tmp_path):
    plain, plain_store = _trained(tmp_path / "plain", mlp_chunk_tokens=0)
    chunked, store = _trained(tmp_path / "chunked", mlp_chunk_tokens=7, offload_slots=2)
    mlps = [m for m in chunked.modules() if "_neutrain_unchunked_forward" in m.__dict__]
    assert mlps and not [m for m in plain.modules() if "_neutrain_unchunked_forward" in m.__dict__]
    assert store.slots == 2 and plain_store.slots == 4
    want, got = decompressed_state_dict(plain), decompressed_state_dict(chunked)
    assert want.keys() == got.keys()
    for name in want:
        # An ulp or two where the chunks' sums round apart from the whole product's.
        torch.testing.assert_close(got[name].float(), want[name].float(), rtol=0, atol=5e-4, msg=name)
