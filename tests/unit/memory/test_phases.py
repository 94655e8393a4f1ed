"""The phase tracker: nested phases measured apart, the highest peak of a phase kept, an out-of-memory
error tagged with the phase it happened in. CUDA's allocator statistics are played by a fake allocator."""

from __future__ import annotations

import pytest
import torch

from neutrain.memory import phases
from neutrain.memory.phases import PHASES, PhaseTracker, out_of_memory_line

MIB = 2**20


class FakeAllocator:
    """The caching allocator's statistics as torch.cuda reports them: allocated, reserved, their peaks."""

    def __init__(self, context: int = 500 * MIB):
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.context = context

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.reserved = max(self.reserved, self.allocated)  # cached blocks are reused before new ones
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, n: int) -> None:
        self.allocated -= n  # stays reserved (cached)

    def reset_peak(self) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def empty_cache(self) -> None:
        self.reserved = self.allocated


@pytest.fixture
def fake(monkeypatch):
    a = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *_: a.peak_allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *_: a.peak_reserved)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *_: a.reserved)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *_: a.reset_peak())
    monkeypatch.setattr(torch.cuda, "empty_cache", a.empty_cache)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(phases, "device_memory_used", lambda *_: a.reserved + a.context)
    return a


def test_a_save_inside_training_is_measured_apart_from_the_steps(fake):
    tracker = PhaseTracker(cuda=True)
    fake.alloc(1000 * MIB)  # the model
    with tracker.phase("build"):
        fake.alloc(300 * MIB)
        fake.free(300 * MIB)  # the build's scratch
    with tracker.phase("train_step"):
        for step, activations in enumerate((150, 100, 50)):  # the steps' peak comes before the save
            fake.alloc(activations * MIB)
            fake.free(activations * MIB)
            if step == 1:
                with tracker.phase("save"):
                    assert tracker.current == "save"
                    fake.alloc(400 * MIB)  # a scratch larger than the steps'
                    fake.free(400 * MIB)
                assert tracker.current == "train_step"
    rec = tracker.records
    assert rec["build"].peak_allocated == 1300 * MIB
    assert rec["train_step"].peak_allocated == 1150 * MIB  # the save's 1400 MiB is not the steps' peak
    assert rec["save"].peak_allocated == 1400 * MIB
    # The save started by handing the steps' cached blocks back: its reservation is its own.
    assert rec["save"].peak_reserved == 1400 * MIB
    assert rec["save"].device_used == 1400 * MIB + fake.context
    assert rec["train_step"].runs == 1 and rec["save"].runs == 1


def test_a_phase_run_twice_keeps_its_highest_peak(fake):
    tracker = PhaseTracker(cuda=True)
    for size in (200, 500, 300):
        with tracker.phase("eval"):
            fake.alloc(size * MIB)
            fake.free(size * MIB)
    assert tracker.records["eval"].peak_allocated == 500 * MIB and tracker.records["eval"].runs == 3
    assert "eval" in tracker.table({"eval": {"reserved_gib": 0.5}})


def test_an_out_of_memory_error_names_the_innermost_phase(fake):
    tracker = PhaseTracker(cuda=True)
    with pytest.raises(torch.OutOfMemoryError) as err:
        with tracker.phase("train_step"), tracker.phase("save"):
            fake.alloc(700 * MIB)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.96 GiB. GPU 0 has a total capacity")
    assert err.value.neutrain_phase == "save"
    assert tracker.records["save"].peak_allocated == 700 * MIB  # measured up to the failure


def test_the_out_of_memory_line_is_one_line_with_phase_budget_and_plan(monkeypatch):
    tracker = PhaseTracker(cuda=False)
    monkeypatch.setattr(phases, "TRACKER", tracker)
    tracker.budget_gib, tracker.predicted = 14.5, {"save": {"reserved_gib": 12.13}}
    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.96 GiB. GPU 0 has a total capacity of 79 GiB")
    exc.neutrain_phase = "save"
    wrapped = RuntimeError("while saving")
    wrapped.__cause__ = exc  # found through the chain, as a library's re-raise leaves it
    line = out_of_memory_line(wrapped)
    assert line.startswith("out of memory in phase 'save' under memory.device_budget_gib=14.5 (Tried to allocate 1.96 GiB")
    assert "the planner predicted 12.13 GiB reserved" in line and "\n" not in line
    assert out_of_memory_line(RuntimeError("something else")) is None


def test_phase_names_are_fixed():
    assert PHASES == ("build", "train_step", "eval", "generate", "save", "resume", "export")
    with pytest.raises(ValueError, match="unknown phase 'saving'"):
        with PhaseTracker(cuda=False).phase("saving"):
            pass


def test_an_out_of_memory_error_outside_any_phase_says_only_what_failed(monkeypatch):
    monkeypatch.setattr(phases, "TRACKER", PhaseTracker(cuda=False))
    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity")
    assert out_of_memory_line(exc) == "out of memory on the device (Tried to allocate 20.00 MiB)"


def test_the_report_puts_each_measured_peak_beside_its_prediction(fake, monkeypatch, tmp_path):
    import json

    from neutrain.cli.memory import phase_lines, phase_report

    tracker = PhaseTracker(cuda=True)
    monkeypatch.setattr(phases, "TRACKER", tracker)
    for name, size in (("build", 300), ("save", 200)):
        with tracker.phase(name):
            fake.alloc(size * MIB)
            fake.free(size * MIB)
    tracker.predicted = {"build": {"allocated_gib": 0.25, "reserved_gib": 0.33, "device_gib": 1.0}}
    summary = {}
    phase_report(summary, None, str(tmp_path), step=7)
    build, save = summary["phase_memory"]["build"], summary["phase_memory"]["save"]
    assert build["peak_reserved_gib"] == 300 / 1024
    assert build["reserved_relative_error"] == pytest.approx(0.33 / (300 / 1024) - 1)
    assert "reserved_relative_error" not in save  # nothing predicted for it
    assert summary["peak_memory_gib"] == 300 / 1024  # the run's peak: the highest phase's
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["phase"]) for r in records] == [(7, "build"), (7, "save")]
    table = phase_lines(summary)
    assert table[1].split() == ["build", "0.29", "0.29", "0.78", "0.33"] and table[2].split()[-1] == "-"


def test_each_phase_is_credited_its_own_wall_time(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(phases.time, "perf_counter", lambda: now[0])
    tracker = PhaseTracker(cuda=False)
    with tracker.phase("train_step"):
        now[0] += 2.0
        with tracker.phase("save"):
            now[0] += 5.0  # the save's time is its own, not the steps'
        now[0] += 1.0
    now[0] += 50.0  # outside any phase: nobody's
    with tracker.phase("train_step"):
        now[0] += 0.5
    assert tracker.records["train_step"].seconds == pytest.approx(3.5)
    assert tracker.records["save"].seconds == pytest.approx(5.0)
    assert tracker.records["save"].as_dict()["seconds"] == 5.0
