"""The planner's memory.offload_weights terms: GPU slots instead of the layers, host bytes, PCIe bytes per step."""

import pytest

from neutrain.config import RecipeError, load_recipe
from neutrain.nn import causal_lm_loss, compress_model
from neutrain.nn.weight_offload_model import offload_weights
from neutrain.optim import LOMO
from neutrain.memory import GIB, ModelShape, estimate, estimate_recipe, offload_traffic
from tests.unit.nn.nn_helpers import (
    CODEC,
    enable_checkpointing,
    tiny_llama,
    token_batches,
)


def test_offload_moves_the_layers_to_host_and_keeps_slots_on_the_gpu():
    shape = ModelShape(8192, 28672, 80, 64, 8, 128256, False, 128)  # Llama-3-70B
    plain = estimate(shape, batch=1, seq=16384, weights="neuzip-lossless", optimizer="lomo")
    off = estimate(shape, batch=1, seq=16384, weights="neuzip-lossless", optimizer="lomo", offload_weights=True)
    traffic = offload_traffic(shape)
    assert abs(plain.terms["weights"] - off.terms["weights"] - traffic["host_weight_bytes"]) < 1
    assert off.terms["weight_slots"] == 4 * traffic["layer_bytes"] * (1 + 1 / 16)
    assert off.reserved < 70 * GIB < plain.reserved  # the 70B at 16K fits an 80 GB card only offloaded
    assert off.settings["h2d_bytes_per_step"] == 2 * 76 * traffic["layer_bytes"]
    assert off.settings["d2h_bytes_per_step"] == traffic["host_weight_bytes"]
    recipe = load_recipe("recipes/llama3_8b.yaml", ["memory.weights=neuzip-lossless", "train.optimizer=lomo",
                                                    "memory.offload_weights=true"])
    assert estimate_recipe(recipe).settings["offload_weights"] is True
    assert "host pinned (weights)" in off.table() and "PCIe in / step" in off.table()
    assert "host pinned" not in plain.table()


@pytest.mark.slow
def test_predicted_copies_per_step_match_the_store():
    layers, slots = 6, 4
    model = tiny_llama(seed=1, layers=layers)
    compress_model(model, progress=False, codec_options=CODEC)
    enable_checkpointing(model)
    store = offload_weights(model, ahead=slots - 2, slots=slots)
    opt = LOMO(model.parameters(), lr=0.01, stochastic_rounding=False).bind(model)
    data = token_batches(3, seed=2)
    for i, ids in enumerate(data):
        if i == len(data) - 1:
            store.stats.reset()  # a steady-state step: the first one starts with nothing on the device
        opt.backward(causal_lm_loss(model, ids, ids))
        opt.step()
    layer_bytes = store.host_bytes / layers  # all layers have the same shapes
    traffic = offload_traffic(ModelShape.from_config(model.config), slots=slots)
    fetched = traffic["h2d_bytes_per_step"] / traffic["layer_bytes"]
    assert store.stats.loads == fetched == 2 * (layers - slots)
    assert abs(store.stats.h2d_bytes - fetched * layer_bytes) < 0.05 * layer_bytes * fetched
    assert abs(store.stats.d2h_bytes - layers * layer_bytes) < 0.05 * layers * layer_bytes


def test_the_shipped_70b_recipe_fits_an_80_gb_card_only_offloaded():
    recipe = load_recipe("recipes/llama3_70b_offload.yaml")
    off = estimate_recipe(recipe)
    assert off.settings["offload_weights"] is True and off.settings["seq"] == 16384
    assert off.reserved < 70 * GIB
    assert 80 * GIB < off.settings["host_weight_bytes"] < 95 * GIB
    plain = estimate_recipe(load_recipe("recipes/llama3_70b_offload.yaml", ["memory.offload_weights=false"]))
    assert plain.reserved > 80 * GIB


def test_some_layers_offloaded_take_their_share_of_host_memory_and_the_link():
    recipe = load_recipe("recipes/llama3_8b.yaml", ["memory.weights=neuzip-lossless", "memory.offload_weights=true",
                                                  "memory.offload_layers=8"])
    part, every = estimate_recipe(recipe), estimate(
        ModelShape(4096, 14336, 32, 32, 8, 128256, False, 128), batch=1, seq=1024, weights="neuzip-lossless",
        optimizer="lomo", offload_weights=True)
    layer = part.settings["layer_bytes"]
    assert part.settings["offloaded"] == (2, 6, 10, 14, 18, 22, 26, 30) and part.settings["offload_slots"] == 2
    assert part.settings["host_weight_bytes"] == 8 * layer == every.settings["host_weight_bytes"] / 4
    assert part.settings["h2d_bytes_per_step"] == 2 * (8 - 2) * layer and part.settings["d2h_bytes_per_step"] == 8 * layer
    assert part.terms["weight_slots"] == 2 * layer * (1 + 1 / 16)
    assert abs(part.terms["weights"] - every.terms["weights"] - 24 * layer) < 1  # the 24 resident layers
    assert "layers in host memory       8 of 32" in part.table()
    # More layers than the model has: one line naming the key (before anything is built).
    with pytest.raises(RecipeError, match=r"^memory\.offload_layers: 40 is more than the model's 32 decoder layers$"):
        estimate_recipe(load_recipe("recipes/llama3_8b.yaml", ["memory.weights=neuzip-lossless", "memory.offload_weights=true",
                                                             "memory.offload_layers=40"]))
