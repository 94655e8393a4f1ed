"""The planner by phase: each phase's terms are real buffers, and the 8B's figures fall within 10% of
what the GPU measured, in the GPU and with its weights and activations offloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neutrain.config import load_recipe
from neutrain.trainer.modeling import config_only
from neutrain.memory.phase_planner import (
    CHECKSUM_SCRATCH_BYTES, ENCODE_SCRATCH_BYTES, peak_phase, phase_estimates, plan_recipe, plan_table,
)
from neutrain.memory import GIB, NEUZIP_BITS, ModelShape, estimate, estimate_recipe

REPO = Path(__file__).resolve().parents[3]
EVERY_PHASE = ["export.format=hf", "eval.perplexity=true", "eval.sample_prompt=Once upon a time"]
MEASURED = json.loads((Path(__file__).with_name("measured_phases_8b.json")).read_text())


def _8b(*overrides: str):
    # NeuZip, as the GPU measured it (the recipe's memory.weights: auto leaves the choice to the fit).
    return load_recipe("recipes/llama3_8b.yaml", ["memory.weights=neuzip-lossless", *EVERY_PHASE, *overrides])


def test_each_phase_is_the_resident_model_plus_its_own_buffers():
    recipe = _8b()
    shape = ModelShape.from_config(config_only(recipe.model))
    vocab_matrix = shape.vocab * shape.hidden  # the largest matrix: the embedding (and the untied lm_head)
    plan = plan_recipe(recipe)
    train = plan["train_step"]
    assert list(plan) == ["build", "train_step", "eval", "generate", "save", "resume", "export"]
    assert train.terms == estimate_recipe(recipe).terms  # the training step is the step planner's
    # A Llama-3-8B layer (0.41 GiB) fits the vocabulary matrix's slot (0.98): the layers decode as groups into
    # that slot's memory (neutrain.nn.groups), held all step; no layer slots, and the loss decodes nothing more.
    assert train.terms["decode_buffers"] == 0 and train.terms["vocab_slot"] == vocab_matrix * 2
    assert "vocab_decode" not in train.terms and train.settings["peak_moment"] == "layer backward"
    for name, e in plan.items():
        if name != "train_step":
            assert e.terms["model"] == train.terms["weights"]  # no phase holds a second copy of the model
    # The large decode slot: reserved by the build (the larger of it and the encoder's scratch), held through
    # training (a save between steps included), given back before the export.
    for name in ("resume", "eval", "generate", "save"):
        assert plan[name].terms["decode_buffers"] == vocab_matrix * 2, name
    assert plan["export"].terms["decode_buffers"] == 0
    # Scratch bounded by the largest matrix: dense bf16 plus the GPU encoder's scratch at build, the
    # checksum's chunks at save, one compressed payload at resume, one dense matrix at export.
    assert plan["build"].terms["scratch"] == vocab_matrix * (2 + ENCODE_SCRATCH_BYTES)
    assert plan["save"].terms["scratch"] == CHECKSUM_SCRATCH_BYTES
    assert plan["resume"].terms["scratch"] == vocab_matrix * NEUZIP_BITS / 8
    assert plan["export"].terms["scratch"] == vocab_matrix * 2
    fp32 = plan_recipe(_8b("export.dtype=float32"))
    assert fp32["export"].terms["scratch"] == vocab_matrix * (2 + 4)  # the decoded matrix and its fp32 cast
    # Generation's KV cache: every layer's keys and values for the prompt and the new tokens.
    longer = plan_recipe(_8b("eval.sample_tokens=1064"))
    per_token = shape.layers * 2 * shape.kv_heads * shape.head_dim * 2
    assert longer["generate"].terms["kv_cache"] - plan["generate"].terms["kv_cache"] == 1000 * per_token
    # Evaluation grows with its micro-batch, without gradients: below the training step at the same batch.
    eval8 = plan_recipe(_8b("eval.micro_batch_size=8"))["eval"]
    assert eval8.terms["activations"] == 8 * plan["eval"].terms["activations"]
    assert plan["eval"].total < train.total
    for e in plan.values():
        assert e.reserved > e.total and e.device > e.reserved


def test_the_weight_stores_slots_come_with_the_first_step():
    plan = plan_recipe(_8b("memory.offload_weights=true", "memory.offload_layers=8"))
    train = plan["train_step"]
    assert train.settings["offloaded_layers"] == 8 and train.settings["offload_slots"] == 2
    for name in ("build", "resume"):  # before any step: the store has allocated no slot yet
        assert plan[name].terms["model"] == train.terms["weights"], name
    for name in ("eval", "generate", "save", "export"):
        assert plan[name].terms["model"] == train.terms["weights"] + train.terms["weight_slots"], name


def test_phases_the_recipe_does_not_run_are_left_out():
    plan = plan_recipe(load_recipe("recipes/llama3_8b.yaml", ["memory.weights=neuzip-lossless"]))  # no perplexity, no sample, export none
    assert list(plan) == ["build", "train_step", "save", "resume"]
    table = plan_table(plan)
    assert table.splitlines()[0].split()[:4] == ["phase", "allocated", "reserved", "device"]
    assert [line.split()[0] for line in table.splitlines()[1:]] == list(plan)


def _variant_d(commit: str | None = None) -> dict:
    from benchmarks import records

    data = records.find("train_memory", commit) if commit else records.current("train_memory")
    return next(v for v in data["results"]["variants"] if v["variant"] == "d")  # NeuZip lossless + LOMO, the recipe


#: The latest record whose NVML figures are its own GPU's (the current one's device-used fields read the
#: other GPU of a two-GPU machine and are null: its row's ``archived`` note in benchmarks/memory/results.jsonl).
DEVICE_USED_COMMIT = "fb37af0"


@pytest.mark.parametrize("batch", [1, 8])
def test_the_8b_training_step_is_within_10_percent_of_the_h200(batch):
    variant = _variant_d()
    measured = variant[f"batch{batch}"]
    train = plan_recipe(_8b(f"train.micro_batch_size={batch}"))["train_step"]
    assert abs(train.total / GIB - measured["peak_allocated_gib"]) <= 0.10 * measured["peak_allocated_gib"]
    assert abs(train.reserved / GIB - measured["peak_reserved_gib"]) <= 0.10 * measured["peak_reserved_gib"]
    # NVML counts what the card held before the process started too; the planner leaves that out.
    nvml = _variant_d(DEVICE_USED_COMMIT)
    device = train.device / GIB + nvml["device_used_idle_gib"]
    assert abs(device - nvml[f"batch{batch}"]["device_used_gib"]) <= 0.10 * nvml[f"batch{batch}"]["device_used_gib"]


def test_the_offloaded_8b_at_batch_8_is_within_10_percent_of_the_h200():
    # benchmarks/offload/results.jsonl#offload: weights and activations offloaded, batch 8 x 1024, on an H200.
    from benchmarks import records

    measured = records.current("offload")["results"]["8b"]["offloaded"]
    plan = plan_recipe(_8b("train.micro_batch_size=8", "memory.offload_weights=true", "memory.offload_activations=true"))
    train = plan["train_step"]
    assert abs(train.total / GIB - measured["peak_allocated_gib"]) <= 0.10 * measured["peak_allocated_gib"]
    assert abs(train.reserved / GIB - measured["peak_reserved_gib"]) <= 0.10 * measured["peak_reserved_gib"]
    assert abs(train.terms["weight_slots"] / GIB - measured["slot_device_gib"]) <= 0.01
    device = train.device / GIB + _variant_d(DEVICE_USED_COMMIT)["device_used_idle_gib"]  # the same kind of card, idle
    assert abs(device - measured["device_used_gib"]) <= 0.10 * measured["device_used_gib"]
    # The offloaded model is the embedding, the lm_head, the norms and, once a step ran, four layers' slots.
    assert plan["save"].terms["model"] == train.terms["weights"] + train.terms["weight_slots"]


FRAGMENTED = 0.5
"""GiB of reserved above allocated that only the resumed runs show (1.47 for the in-GPU step after the resume,
1.65 for its save and export): the resume leaves the caching allocator fragmented, which no planner term
models and an empty_cache after the resume removes; there the allocated figure is compared alone."""


@pytest.mark.parametrize("placement", ["in_gpu", "offloaded"])
def test_every_phase_of_the_8b_is_within_10_percent_of_the_gpu_in_both_placements(placement):
    config = MEASURED["placements"][placement]
    plan = plan_recipe(_8b("train.micro_batch_size=1", *config["overrides"]))
    compared = set()
    for run, phases in config["runs"].items():
        for phase, (allocated, reserved) in phases.items():
            predicted = plan[phase]
            where = f"{placement} {run} {phase}: predicted {predicted.total / GIB:.2f} / {predicted.reserved / GIB:.2f}"
            assert abs(predicted.total / GIB / allocated - 1) <= 0.10, where
            if reserved - allocated < FRAGMENTED:
                assert abs(predicted.reserved / GIB / reserved - 1) <= 0.10, where
                compared.add(phase)
    # Every phase's reserved is held to 10% somewhere, but the in-GPU export's (measured in a resumed run only).
    every = {"build", "train_step", "save", "resume", "export"}
    assert compared == (every - {"export"} if placement == "in_gpu" else every)
    # 5.0 GiB (a 6 GB card) holds every phase with every layer offloaded: the build measured 3.04, the step 4.10.
    if placement == "offloaded":
        assert max(e.reserved for e in plan.values()) < 5 * GIB


def test_the_streaming_phases_stay_near_the_training_step():
    # No phase above 1.05x the training step: save, resume and export are well inside, and the build
    # (the dense lm_head and its encoder scratch) stays below the step.
    plan = plan_recipe(_8b())
    train = plan["train_step"].reserved
    for name in ("build", "eval", "generate", "save", "resume", "export"):
        assert plan[name].reserved <= 1.05 * train, name
    assert peak_phase(plan)[0] == "train_step"


def test_dense_weights_have_no_decode_buffers_or_encoder_scratch():
    shape = ModelShape(64, 176, 3, 4, 2, 300, False, 16)
    train = estimate(shape, batch=2, seq=32, weights="dense", optimizer="lomo")
    plan = phase_estimates(shape, train, eval_batch=2, export_format="neuzip")
    largest = 300 * 64
    assert plan["build"].terms["scratch"] == largest * 2
    assert plan["save"].terms["scratch"] == largest * 2
    assert plan["export"].terms["scratch"] == largest * (2 + ENCODE_SCRATCH_BYTES)  # compressed on export
    assert "decode_buffers" not in train.terms and "vocab_decode" not in train.terms
    assert plan["eval"].terms["decode_buffers"] == 0
