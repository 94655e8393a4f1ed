"""The planner counts the weights the build makes, for every architecture the test-suite trains.

Each architecture of the training matrix (``tests/integration/test_architectures.py``: dense, tied,
biased, MoE with and without shared experts, MLA) is built tiny and dense on the CPU by neutrain's own
build (random init, bf16), and the planner's dense ``weights`` term, read from the same config before
anything is built, must equal the built model's parameter bytes exactly. Buffers (rotary frequencies,
Gemma's embedding scale) are not parameters and are left out of both sides: they are not trained,
compressed or offloaded, and are a few KiB for the real models.
"""

from __future__ import annotations

import pytest
import torch

from neutrain.memory import ModelShape, estimate
from tests.integration.test_architectures import ARCHITECTURES, _config

MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


def _built_bytes(config) -> int:
    from neutrain.nn.load import build
    from neutrain.nn.model_spec import ModelSpec, Placement
    from neutrain.nn.sources import RandomInit

    model, _ = build(ModelSpec(RandomInit(seed=0), config, torch.bfloat16, placement=Placement("dense")),
                     progress=False)
    return sum(p.numel() * p.element_size() for p in model.parameters())  # a tied weight once


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_planned_weights_are_the_built_weights(arch):
    config = _config(arch)
    shape = ModelShape.from_config(config)
    planned = estimate(shape, batch=1, seq=8, weights="dense").terms["weights"]
    assert planned == _built_bytes(config), f"{arch}: the planner counts {planned:,} bytes"


def test_the_matrix_table_counts_every_expert():
    # The experts are matrices the build compresses: a mixture of four experts has four MLPs a layer, where a
    # dense model of its numbers has one.
    config = _config("mixtral")
    shape = ModelShape.from_config(config)
    dense = ModelShape(shape.hidden, shape.intermediate, shape.layers, shape.heads, shape.kv_heads, shape.vocab,
                       shape.tied, shape.head_dim)  # the eight numbers alone: the closed form
    mlp = 3 * shape.intermediate * shape.hidden
    per_layer_experts = config.num_local_experts * (mlp + shape.hidden)  # and the router's row for each
    assert shape.matrix_params() - dense.matrix_params() == shape.layers * (per_layer_experts - mlp)
    assert shape.matrix_params() == sum(r * c for _, r, c in shape.matrices())
    assert shape.largest_layer_matrix() == 2 * config.num_local_experts * shape.intermediate * shape.hidden


def test_a_config_deeper_than_the_skeleton_repeats_its_last_layer(monkeypatch):
    # The preflight reads configs of any depth: past BUILT_LAYERS the last built layer stands for the rest.
    from neutrain.memory import shape as module

    config = _config("llama")
    config.num_hidden_layers = 5
    exact = ModelShape.from_config(config)
    monkeypatch.setattr(module, "BUILT_LAYERS", 2)
    deep = ModelShape.from_config(config)
    assert len(deep.per_layer) == 2 and deep.params() == exact.params()
