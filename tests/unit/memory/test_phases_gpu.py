"""On CUDA: the budget is the allocator's hard limit, phases measure real peaks, and a run through the CLI
stays inside its budget in every phase and names the phase of an allocation over it.

Run on the device machine: ``pytest -m gpu tests/unit/memory/test_phases_gpu.py``.
"""

from __future__ import annotations

import json

import pytest
import torch

from neutrain.memory import enforce_budget
from neutrain.memory.phases import PhaseTracker, out_of_memory_line
from tests.helpers import write_recipe

pytestmark = pytest.mark.gpu
MIB = 2**20


@pytest.fixture
def cuda_budget():
    """Restores the allocator's limit (process-wide) and hands cached blocks back after the test."""
    yield
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()


def test_nested_phases_measure_real_peaks():
    tracker = PhaseTracker(cuda=True)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    with tracker.phase("train_step"):
        a = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
        del a
        with tracker.phase("save"):
            b = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
            del b
        c = torch.empty(32 * MIB, dtype=torch.uint8, device="cuda")
        del c
    save, train = tracker.records["save"], tracker.records["train_step"]
    assert save.peak_allocated >= base + 256 * MIB and save.peak_reserved >= save.peak_allocated
    assert base + 64 * MIB <= train.peak_allocated < base + 256 * MIB  # the save's tensor is not the steps'
    assert save.device_used >= save.peak_reserved  # NVML's figure includes the CUDA context


def test_the_budget_is_a_hard_limit_and_an_allocation_over_it_names_the_phase(cuda_budget):
    torch.cuda.empty_cache()
    budget = torch.cuda.memory_reserved() + 512 * MIB
    enforce_budget(budget, torch.cuda.current_device())
    tracker = PhaseTracker(cuda=True)
    kept = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")  # fits
    with pytest.raises(torch.OutOfMemoryError) as err:
        with tracker.phase("train_step"), tracker.phase("export"):
            torch.empty(512 * MIB, dtype=torch.uint8, device="cuda")  # 768 MiB in all: over the budget
    del kept
    assert err.value.neutrain_phase == "export"
    line = out_of_memory_line(err.value, budget / 2**30)
    assert line.startswith("out of memory in phase 'export' under memory.device_budget_gib=") and "\n" not in line
    assert "Tried to allocate 512.00 MiB" in line


def test_a_cuda_run_keeps_every_phase_inside_its_budget(tmp_path, capsys, cuda_budget):
    from neutrain.cli import main as neutrain

    recipe = write_recipe(
        tmp_path, model={"dtype": "bfloat16"},
        train={"max_steps": 2, "save_steps": 2, "use_cpu": False, "optimizer": "lomo", "learning_rate": 1e-3},
        memory={"weights": "neuzip-lossless", "gradient_checkpointing": True, "device_budget_gib": 2},
        eval={"perplexity": True, "max_eval_samples": 4, "sample_prompt": "def", "sample_tokens": 4},
        export={"format": "hf"})
    rc = neutrain([str(recipe)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["memory_fit"]["choice"] == "on the GPU"
    phases = summary["phase_memory"]
    assert {"build", "train_step", "eval", "generate", "save", "export"} <= set(phases)
    for name, entry in phases.items():
        assert 0 < entry["peak_allocated_gib"] <= entry["peak_reserved_gib"] <= 2.0, (name, entry)
        assert entry["device_used_gib"] >= entry["peak_reserved_gib"], (name, entry)
    # Resume is its own phase: two more steps from the checkpoint.
    rc = neutrain([str(recipe), "train.max_steps=4", "train.resume_from_checkpoint=true"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["phase_memory"]["resume"]["peak_reserved_gib"] <= 2.0


def test_phase_report_puts_the_measured_peak_beside_the_prediction(tmp_path, monkeypatch):
    from neutrain.cli.memory import phase_report
    from neutrain.memory import phases

    tracker = PhaseTracker(cuda=True)
    monkeypatch.setattr(phases, "TRACKER", tracker)
    with tracker.phase("save"):
        x = torch.empty(128 * MIB, dtype=torch.uint8, device="cuda")
        del x
    measured = tracker.records["save"].peak_reserved / 2**30
    tracker.predicted = {"save": {"allocated_gib": 0.1, "reserved_gib": 2 * measured, "device_gib": 1.0}}
    summary = {}
    phase_report(summary, None, str(tmp_path), step=3)
    entry = summary["phase_memory"]["save"]
    assert entry["reserved_relative_error"] == pytest.approx(1.0)
    assert summary["peak_reserved_gib"] == pytest.approx(measured)
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["phase"] == "save" and record["step"] == 3 and record["predicted_reserved_gib"] == 2 * measured
