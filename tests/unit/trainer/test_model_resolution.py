"""The recipe's model section resolved once into a typed description: the offload keys reach the placement."""

import pytest
import torch

from neutrain.config import load_recipe
from neutrain.data import byte_tokenizer
from neutrain.nn.weight_offload_model import weight_store
from neutrain.trainer.modeling import build_model, resolve_model


@pytest.mark.slow
def test_offload_layers_reaches_the_placement_and_the_build():
    recipe = load_recipe("default", ["memory.offload_weights=true", "memory.offload_layers=2"])
    spec = resolve_model(recipe.model, byte_tokenizer(), use_cpu=True, weights="neuzip-lossless",
                         offload_weights=True, offload_layers=recipe.memory.offload_layers)
    assert spec.placement.offload and spec.placement.layers == 2
    model = build_model(recipe.model, byte_tokenizer(), use_cpu=True, weights="neuzip-lossless",
                        offload_weights=True, offload_layers=2)
    store = weight_store(model)
    assert len(store.layers) == 2 and (store.ahead, store.slots) == (1, 2)  # layers 1 and 3 of 4
    assert sorted(layer.weights[0].name.split(".")[2] for layer in store.layers) == ["1", "3"]


def test_a_dense_build_ignores_the_offload_keys():
    recipe = load_recipe("default")
    spec = resolve_model(recipe.model, byte_tokenizer(), use_cpu=True, weights="dense", offload_weights=True,
                         offload_layers=2)
    assert not spec.placement.offload and spec.placement.layers is None and spec.dtype in (torch.float32, torch.bfloat16)
