"""The step-time model against the GPU's records: within 15% of every timing row it is held to.

The fit ranks configurations by :mod:`neutrain.memory.step_time`, so the model has to say how fast each
really ran. Its rates are constants calibrated on committed records; when new GPU runs recalibrate them,
these tests say whether the model still lands on every measured row, and which one it misses.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from neutrain.config import load_recipe
from neutrain.memory import step_time as model
from neutrain.memory import apply_changes
from neutrain.memory import ModelShape, estimate_recipe
from neutrain.memory.step_time import CPU, GPU, step_time

REPO = Path(__file__).resolve().parents[3]
from benchmarks import records

CARDS = records.current("cards")
TRAIN_MEMORY = records.current("train_memory")
LLAMA3_8B = ModelShape(4096, 14336, 32, 32, 8, 128256, False, 128)


def _runs_the_current_path(row: dict) -> bool:
    """A cards row the model describes: written by the current cards benchmark (it records the fit's own
    prediction), or a configuration with layers in host memory, whose NeuZip path (one matrix at a time) is
    the one it ran. Rows of NeuZip layers on the GPU from before layer groups (neutrain.nn.groups) ran a
    path that no longer exists; train_memory.json's d measures the current one."""
    changes = (row.get("choice") or {}).get("changes") or {}
    return "predicted_tokens_per_s" in row or bool(changes.get("memory.offload_weights"))


TIMING = {name: row for name, row in CARDS["results"]["timing"].items()
          if row.get("tokens_per_s") and _runs_the_current_path(row)}
STEPS = {f"{r['variant']}_b{b}": r[f"batch{b}"] for r in TRAIN_MEMORY["results"]["variants"]
         if r.get("variant") in ("c", "d") for b in (1, 8) if r.get(f"batch{b}", {}).get("tokens_per_s")}


def predicted_tokens_per_s(row: dict) -> float:
    """The model's tok/s for the configuration a timing row ran: the recipe with the row's overrides, then
    the fit's changes. Rows from before ``memory.weights: auto`` ran the recipe's NeuZip weights."""
    overrides = row.get("overrides") or [f"train.micro_batch_size={row['micro_batch_size']}"]
    recipe = load_recipe(REPO / CARDS["settings"]["recipe"], overrides)
    changes = dict((row.get("choice") or {}).get("changes") or {})
    if recipe.memory.weights == "auto" and "memory.weights" not in changes:
        changes["memory.weights"] = row.get("weights") or "neuzip-lossless"
    chosen = apply_changes(recipe, changes)
    return step_time(estimate_recipe(chosen, LLAMA3_8B), LLAMA3_8B, GPU,
                     chosen.train.gradient_accumulation_steps).tokens_per_s


@pytest.mark.parametrize("name", sorted(TIMING))
def test_the_model_lands_within_15_percent_of_every_cards_timing_row(name):
    row = TIMING[name]
    predicted = predicted_tokens_per_s(row)
    error = predicted / row["tokens_per_s"] - 1
    assert abs(error) <= 0.15, (f"{name}: predicted {predicted:,.0f} tok/s, measured {row['tokens_per_s']:,.1f} "
                                f"({error:+.1%}); recalibrate neutrain/memory/step_time.py's constants")
    if row.get("predicted_tokens_per_s") is not None:  # what the run's own fit predicted, recorded beside it
        assert abs(row["predicted_tokens_per_s"] / row["tokens_per_s"] - 1) <= 0.15, name


@pytest.mark.parametrize("name", sorted(STEPS))
def test_the_model_lands_within_15_percent_of_the_training_steps_measured_with_the_current_code(name):
    """train_memory.json's dense (c) and NeuZip (d) steps at batch 1 (host-bound) and 8 (device-bound)."""
    variant, batch = name.split("_b")
    weights = "dense" if variant == "c" else "neuzip-lossless"
    recipe = load_recipe(REPO / "recipes" / "llama3_8b.yaml", [f"memory.weights={weights}", f"train.micro_batch_size={batch}"])
    predicted = step_time(estimate_recipe(recipe, LLAMA3_8B), LLAMA3_8B, GPU).tokens_per_s
    measured = STEPS[name]["tokens_per_s"]
    assert abs(predicted / measured - 1) <= 0.15, f"{name}: predicted {predicted:,.0f}, measured {measured:,.0f} tok/s"


def test_the_records_hold_the_timing_rows_the_model_is_held_to():
    # Host-bound (batch 1) and device-bound (batch 8) steps in the GPU, dense and NeuZip; 9 layers streamed at
    # batch 1 and activations and 27 layers streamed at batch 8: the link's side of the model.
    assert {"c_b1", "c_b8", "d_b1", "d_b8"} <= set(STEPS)
    assert {"b1_11", "b8_7"} <= set(TIMING)


def _constants() -> dict[str, str]:
    """``{name: docstring}`` of step_time's module-level numbers (a string right after the assignment)."""
    tree = ast.parse(Path(model.__file__).read_text())
    found = {}
    for node, after in zip(tree.body, tree.body[1:]):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id.isupper() and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, (int, float))):
            doc = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else ""
            found[node.targets[0].id] = doc
    return found


def test_every_rate_is_a_constant_naming_the_record_it_was_calibrated_on():
    constants = _constants()
    assert {"GEMM_FLOPS_PER_S", "ATTENTION_FLOPS_PER_S", "CODEC_BYTES_PER_S", "HOST_S_PER_TENSOR",
            "HOST_S_PER_COMPRESSED", "PCIE_BYTES_PER_S", "COPY_HIDDEN_SHARE", "CPU_FLOPS_PER_S"} <= set(constants)
    for name, doc in constants.items():
        # a record is named ``<topic>/results.jsonl#<name>`` or, in the flat layout's words, ``<name>.json``: either
        # way the current row of <name> in its topic's table
        named = [a or b for a, b in re.findall(r"results\.jsonl#(\w+)|([a-z_0-9]+)\.json\b", doc)]
        assert named, f"{name}: its docstring names no record"
        assert all(records.current(r) for r in named), (name, named)
    # The rates the fit uses are these constants, not copies of them.
    assert GPU.gemm_flops_per_s == model.GEMM_FLOPS_PER_S and GPU.host_s_per_tensor == model.HOST_S_PER_TENSOR
    assert GPU.link_bytes_per_s == model.PCIE_BYTES_PER_S and CPU.gemm_flops_per_s == model.CPU_FLOPS_PER_S


def test_a_step_is_the_slower_of_host_and_device_plus_the_unhidden_link():
    def predict(*overrides):
        recipe = load_recipe(REPO / "recipes" / "llama3_8b.yaml", list(overrides))
        return step_time(estimate_recipe(recipe, LLAMA3_8B), LLAMA3_8B, GPU)

    # Batch 1 is host-bound, NeuZip's host longer than dense's; batch 8 is device-bound.
    dense, neuzip = predict("memory.weights=dense"), predict("memory.weights=neuzip-lossless")
    assert dense.bound == neuzip.bound == "host" and neuzip.host_s > dense.host_s
    assert dense.step_s == dense.host_s and dense.link_s == 0
    wide = predict("memory.weights=neuzip-lossless", "train.micro_batch_size=8")
    assert wide.bound == "device" and wide.step_s == wide.device_s and wide.host_s == neuzip.host_s
    # Streaming layers adds their unhidden copy time, and takes the model back to one matrix at a time (no
    # layer groups with layers in host memory: the longer host cost per matrix).
    streamed = predict("memory.weights=neuzip-lossless", "memory.offload_weights=true", "memory.offload_layers=9")
    bytes_ = streamed.link_s * model.PCIE_BYTES_PER_S / (1 - model.COPY_HIDDEN_SHARE)
    per_matrix = (streamed.host_s - dense.host_s) / (7 * 32 + 2)
    assert per_matrix == pytest.approx(model.HOST_S_PER_COMPRESSED) and per_matrix > model.HOST_S_PER_GROUPED
    assert streamed.step_s == pytest.approx(streamed.host_s + streamed.link_s) and bytes_ == pytest.approx(6.354 * 2**30, rel=1e-3)
    assert (neuzip.host_s - dense.host_s) / (7 * 32 + 2) == pytest.approx(model.HOST_S_PER_GROUPED)
    # On a CPU host and device are one: their times add.
    recipe = load_recipe(REPO / "recipes" / "llama3_8b.yaml", ["memory.weights=dense"])
    cpu = step_time(estimate_recipe(recipe, LLAMA3_8B), LLAMA3_8B, CPU)
    assert cpu.serial and cpu.step_s == cpu.host_s + cpu.device_s + cpu.link_s
    # Accumulation: every micro-batch runs forward and backward, so the step takes about as many times longer.
    halves = step_time(estimate_recipe(apply_changes(recipe, {"train.micro_batch_size": 1}), LLAMA3_8B), LLAMA3_8B,
                       GPU, accumulation=8)
    assert halves.tokens == 8 * 1024 and halves.host_s == pytest.approx(8 * dense.host_s)
