"""``memory.weights: auto``: dense and NeuZip lossless train the same model, so a run may switch at a resume.

A run started dense on a card that holds the model dense and resumed where it must be compressed (or the
other way) continues bit for bit: the same losses and final weights as an uninterrupted run. Tiny CPU runs
in bf16 with AdaLomo (its factored moments are optimizer state that must survive the switch) and
stochastic rounding.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from neutrain.cli.train import build_trainer
from neutrain.config import load_recipe
from neutrain.nn import CompressedLinear, decompressed_state_dict
from neutrain.nn.weight_offload_model import weight_store
from neutrain.trainer.callbacks import read_metrics
from tests.helpers import write_recipe


def _recipe(tmp_path: Path, weights: str, **memory):
    return load_recipe(write_recipe(
        tmp_path, model={"dtype": "bfloat16"}, memory={"weights": weights, "stochastic_rounding": True, **memory},
        train={"optimizer": "adalomo", "learning_rate": 5e-2, "max_steps": 4, "save_steps": 2,
               "lr_scheduler": "constant", "warmup_steps": 0},
        eval={"perplexity": False}, export={"format": "none"}))


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


def _train(tmp_path: Path, weights: str, resume: Path | None = None, **memory):
    """Train to step 4 (from ``resume``, a checkpoint-2 copied into this run's directory); (losses, weights)."""
    recipe = _recipe(tmp_path, weights, **memory)
    out = Path(recipe.train.output_dir)
    if resume is not None:
        shutil.copytree(resume, out / resume.name)
        resume = out / resume.name
    ctx = build_trainer(recipe, resume=None if resume is None else str(resume))
    assert isinstance(ctx.trainer.model.model.layers[0].mlp.up_proj, CompressedLinear) == (weights != "dense")
    assert (weight_store(ctx.trainer.model) is not None) == bool(memory.get("offload_weights"))
    ctx.trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    return _losses(out), decompressed_state_dict(ctx.trainer.model)


def _assert_same(run, reference, what):
    losses, weights = run  # a resumed run logs the steps after its checkpoint
    assert losses and losses == {step: reference[0][step] for step in losses}, what
    assert weights.keys() == reference[1].keys() and all(torch.equal(weights[k], reference[1][k]) for k in weights), what


def test_a_run_switches_between_dense_and_neuzip_at_a_resume_bit_for_bit(tmp_path):
    dense = _train(tmp_path / "dense", "dense")
    compressed = _train(tmp_path / "compressed", "neuzip-lossless")
    assert sorted(dense[0]) == [1, 2, 3, 4]
    _assert_same(compressed, dense, "uninterrupted: NeuZip lossless trains the dense model")
    # Dense for two steps, then compressed from its checkpoint; and the other way.
    to_compressed = _train(tmp_path / "d2c", "neuzip-lossless", resume=tmp_path / "dense" / "out" / "checkpoint-2")
    assert sorted(to_compressed[0]) == [3, 4]
    _assert_same(to_compressed, dense, "dense checkpoint resumed compressed")
    to_dense = _train(tmp_path / "c2d", "dense", resume=tmp_path / "compressed" / "out" / "checkpoint-2")
    _assert_same(to_dense, dense, "compressed checkpoint resumed dense")
    # A small card: the dense checkpoint resumed with a decoder layer's compressed weights in host memory.
    to_offloaded = _train(tmp_path / "d2o", "neuzip-lossless", resume=tmp_path / "dense" / "out" / "checkpoint-2",
                          offload_weights=True, offload_layers=1)
    _assert_same(to_offloaded, dense, "dense checkpoint resumed compressed, a layer offloaded")


def test_a_dense_fp32_checkpoint_is_not_resumed_into_bf16_neuzip(tmp_path):
    from neutrain.errors import CheckpointError

    recipe = load_recipe(write_recipe(tmp_path / "fp32", model={"dtype": "float32"}, memory={"weights": "dense"},
                                      train={"optimizer": "lomo", "max_steps": 2, "save_steps": 2},
                                      eval={"perplexity": False}, export={"format": "none"}))
    build_trainer(recipe).trainer.train()
    checkpoint = Path(recipe.train.output_dir) / "checkpoint-2"
    compressed = _recipe(tmp_path / "bf16", "neuzip-lossless")
    ctx = build_trainer(compressed)
    with pytest.raises(CheckpointError, match=r"is stored in float32, this run's weights in bfloat16"):
        ctx.trainer._load_from_checkpoint(str(checkpoint))


def test_auto_weights_resolve_before_the_build_and_the_run_says_which(tmp_path, monkeypatch):
    import neutrain.cli.memory as memory
    import neutrain.cli.preflight as preflight

    said = []
    eight_b = load_recipe("recipes/llama3_8b.yaml", ["train.use_cpu=true"])  # planned only, never built
    monkeypatch.setattr(preflight, "host_memory_available", lambda: 64 * 2**30)
    assert memory.settle_weights(eight_b, said.append).memory.weights == "dense"
    monkeypatch.setattr(preflight, "host_memory_available", lambda: 14 * 2**30)  # 16.8 GiB dense does not fit
    assert memory.settle_weights(eight_b, said.append).memory.weights == "neuzip-lossless"
    assert said[0].startswith("memory: weights dense (needs 16.78 GiB of the host's 64.00 GiB; NeuZip would be used")
    assert said[1].startswith("memory: weights neuzip-lossless (dense needs 16.78 GiB of the host's 14.00 GiB)")
    # A trainer built from Python with auto: resolved there, dense on this host for a tiny model.
    ctx = build_trainer(_recipe(tmp_path, "auto"))
    assert ctx.recipe.memory.weights == "dense"
    assert not isinstance(ctx.trainer.model.model.layers[0].mlp.up_proj, CompressedLinear)
    assert "weights: dense" in (Path(ctx.recipe.train.output_dir) / "recipe.yaml").read_text()
