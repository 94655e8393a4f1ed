"""memory.device_budget_gib through the CLI: an allocation over the budget ends the run with one
line naming the phase; nothing fitting the budget is one line and exit 2 before anything is built; a run
records the fit and each phase's memory in summary.json and metrics.jsonl.

Tiny CPU runs, in-process through ``neutrain.cli.main``. A CPU has no allocator limit, so the
out-of-memory errors are raised where the phase's own code would allocate.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from neutrain.cli import main as neutrain
from neutrain.memory import PHASES
from tests.helpers import one_error_line, write_recipe

OOM = "CUDA out of memory. Tried to allocate 1.96 GiB. GPU 0 has a total capacity of 14.50 GiB"


def _run(capsys, recipe: Path, *overrides: str) -> tuple[int, str, str]:
    rc = neutrain([str(recipe), *overrides])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err



def _out_of_memory(*_args, **_kwargs):
    raise torch.OutOfMemoryError(OOM)


@pytest.mark.parametrize("where", ["build", "save"])
def test_an_allocation_over_the_budget_ends_in_one_line_naming_the_phase(tmp_path, capsys, monkeypatch, where):
    if where == "build":
        import neutrain.trainer.modeling as modeling

        monkeypatch.setattr(modeling, "build_model", _out_of_memory)  # the model's first large allocation
    else:
        from neutrain.trainer.trainer import NeuTrainer

        monkeypatch.setattr(NeuTrainer, "_save", _out_of_memory)  # inside the checkpoint save at step 2
    recipe = write_recipe(tmp_path, train={"max_steps": 2, "save_steps": 2}, memory={"device_budget_gib": 1.5},
                          eval={"perplexity": False}, export={"format": "none"})
    rc, _, err = _run(capsys, recipe)
    line = one_error_line(err)
    assert rc == 1
    assert line.startswith(f"neutrain: error: out of memory in phase '{where}' under memory.device_budget_gib=1.5 "
                           "(Tried to allocate 1.96 GiB")
    assert f"the planner predicted" in line  # the plan for that phase, beside it


def test_nothing_fitting_the_budget_is_one_line_and_exit_2_before_the_build(tmp_path, capsys):
    recipe = write_recipe(tmp_path, memory={"device_budget_gib": 0.01})
    rc, _, err = _run(capsys, recipe)
    line = one_error_line(err)
    assert rc == 2
    assert line.startswith("neutrain: error: memory.device_budget_gib: nothing fits a budget of 0.01 GiB")
    assert "needs a budget of" in line
    assert not (tmp_path / "out" / "recipe.yaml").exists()  # refused before the build (which saves it)


def test_a_run_records_the_fit_and_each_phase_beside_its_prediction(tmp_path, capsys):
    recipe = write_recipe(tmp_path, train={"max_steps": 2, "save_steps": 2}, memory={"device_budget_gib": 2},
                          eval={"perplexity": True, "max_eval_samples": 4, "sample_prompt": "def", "sample_tokens": 4},
                          export={"format": "hf"})
    rc, out, err = _run(capsys, recipe)
    assert rc == 0, err
    assert "memory: fits the 2.00 GiB budget" in out  # the one line, printed before the build
    out_dir = tmp_path / "out"
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["memory_fit"]["choice"] == "in memory" and summary["memory_fit"]["budget_gib"] == 2  # a CPU
    assert summary["memory_fit"]["weights"] == "dense" and summary["memory_fit"]["predicted_tokens_per_s"] > 0
    ran = ["build", "train_step", "eval", "generate", "save", "export"]
    assert list(summary["phase_memory"]) == [p for p in PHASES if p in ran]
    for name, entry in summary["phase_memory"].items():
        assert entry["runs"] >= 1 and entry["predicted_reserved_gib"] > entry["predicted_allocated_gib"] > 0, name
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    by_phase = {r["phase"]: r for r in records if "phase" in r}
    assert set(by_phase) == set(ran) and all(r["step"] == 2 for r in by_phase.values())
    assert by_phase["save"]["predicted_allocated_gib"] == summary["phase_memory"]["save"]["predicted_allocated_gib"]
    # The summary's table is left out on a CPU, where no phase's GPU memory was measured (all dashes); the
    # record above keeps every phase's prediction.
    assert "memory by phase" not in out and "memory fit      fits the 2.00 GiB budget" in out
    # A longer relaunch resumes from checkpoint-2: the resume is its own phase, recorded at step 4.
    rc, out, err = _run(capsys, recipe, "train.max_steps=4", "train.resume_from_checkpoint=true", "eval.perplexity=false",
                        "export.format=none")
    assert rc == 0, err
    resumed = json.loads((out_dir / "summary.json").read_text())["phase_memory"]
    assert resumed["resume"]["runs"] >= 1 and resumed["resume"]["predicted_reserved_gib"] > 0
    assert "eval" not in resumed  # the second run's own phases only
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert {r["phase"] for r in records if r.get("step") == 4 and "phase" in r} == set(resumed)


def test_estimate_prints_the_phases_the_budget_and_the_choice(capsys):
    rc = neutrain(["estimate", "recipes/llama3_8b.yaml", "memory.device_budget_gib=11"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.splitlines()[0].endswith("weights neuzip-lossless (memory.weights: auto), optimizer lomo, checkpointing True")
    table = out.split("predicted peak by phase (GiB)\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split()[0] for line in table] == ["phase", "build", "train_step", "save", "resume"]
    assert "budget: 11.00 GiB (memory.device_budget_gib: 11.0)" in out
    prefix = "chosen configuration: memory.weights=neuzip-lossless, memory.offload_weights=True, memory.offload_layers="
    chosen = out.split(prefix, 1)[1].split("\n")[0]
    assert (f"memory: weights neuzip-lossless (dense needs 16.78 GiB), offloading {chosen} of 32 decoder layers' "
            "weights: on the GPU it needs 12.04 GiB (phase 'train_step')") in out
    assert f"decoder layers in host memory: {chosen} of 32 (" in out
    # Every configuration family tried, with its predicted peak, host memory and speed; the chosen one marked.
    rows = out.split("configurations (tok/s predicted on an H200, fastest first)\n", 1)[1].split("\nmemory: ", 1)[0]
    rows = rows.splitlines()[1:]
    assert [row.split("  ")[-1] for row in rows if row.endswith("<- chosen")] == ["<- chosen"]
    assert any(row.endswith("no    dense weights on the GPU") for row in rows)
    assert any(row.endswith(f"yes   NeuZip weights, offloading {chosen} of 32 decoder layers' weights  <- chosen")
               for row in rows)
    speeds = [float(row.split()[2].replace(",", "")) for row in rows]
    assert speeds == sorted(speeds, reverse=True) and len(rows) >= 5  # fastest first
    rc = neutrain(["estimate", "recipes/llama3_8b.yaml", "memory.device_budget_gib=2"])
    captured = capsys.readouterr()
    assert rc == 2 and "nothing fits a budget of 2.00 GiB" in one_error_line(captured.err)


@pytest.mark.parametrize("card_gb, offloaded", [(16, False), (12, True)])
def test_on_a_gpu_the_fit_is_applied_and_the_budget_is_the_allocators_limit(monkeypatch, card_gb, offloaded):
    # A fake card: what fit_memory reads from torch.cuda, and the limit it sets.
    from types import SimpleNamespace

    from neutrain.cli.memory import fit_memory
    from neutrain.config import load_recipe
    from neutrain.memory import auto_budget

    total, limits, said = card_gb * 10**9, [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=total))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: limits.append((f, device)))
    state = SimpleNamespace(device=torch.device("cuda"), is_main_process=True)
    recipe, fit = fit_memory(load_recipe("recipes/llama3_8b.yaml"), state, said.append)  # budget: auto
    assert limits == [(auto_budget(total) / total, 0)]  # a device index, as torch requires
    assert isinstance(limits[0][0], float)
    assert recipe.memory.weights == "neuzip-lossless"  # dense (16.8 GiB) fits neither card
    assert recipe.memory.offload_weights is offloaded and recipe.memory.offload_activations is False
    assert (recipe.memory.offload_layers is not None) is offloaded  # a part of the layers: the fastest that fits
    assert said == [fit.line] and fit.line.startswith("memory: weights neuzip-lossless (dense needs 16.78 GiB), " + (
        f"offloading {recipe.memory.offload_layers} of 32 decoder layers' weights" if offloaded else "fits the"))
    # memory.device_budget_gib: none: no limit, the recipe as it is but for the weights, which the card holds dense.
    limits.clear()
    recipe, fit = fit_memory(load_recipe("recipes/llama3_8b.yaml", ["memory.device_budget_gib=none"]), state, said.append)
    assert limits == [] and recipe.memory.offload_weights is False
    assert fit.changes == {"memory.weights": "neuzip-lossless" if card_gb < 18 else "dense"}
