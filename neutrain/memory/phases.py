"""The phases of a run, and the device memory each one peaked at.

Why: a memory budget is a promise about every phase of a run (build or load, the training steps,
evaluation, the sample, checkpoint save, resume and export), not only the training step. The
planner predicts each phase's peak (:mod:`neutrain.memory.phase_planner`); this module measures
it, and remembers which phase is running, so that an allocation over the budget ends the run with
one line naming the phase instead of a traceback.

The phase names are fixed (:data:`PHASES`): scripts read them from ``metrics.jsonl`` and
``summary.json``. On CUDA, :func:`phase` resets the allocator's peak statistics on entry and, on
exit, records the peak allocated and reserved bytes and the device memory in use (NVML's view, which
includes the CUDA context). Phases nest: a checkpoint save inside training is measured as ``save``
and left out of ``train_step``, whose record is the peak over the training steps alone. A phase that
runs several times keeps its highest peak.

Example:
    >>> tracker = PhaseTracker(cuda=False)
    >>> with tracker.phase("train_step"):
    ...     with tracker.phase("save"):
    ...         tracker.current
    'save'
    >>> sorted(tracker.records), tracker.current is None
    (['save', 'train_step'], True)
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass
from typing import Iterator

import torch

GIB = 2**30
PHASES = ("build", "train_step", "eval", "generate", "save", "resume", "export")
# Phases that start by handing the allocator's cached blocks back: training leaves activations'
# blocks cached, and without this a save's peak reserved would read the training's, not its own.
_RELEASE_CACHE = frozenset(("eval", "generate", "save", "resume", "export"))


@dataclass
class PhaseRecord:
    """The highest peaks a phase reached (bytes; zero where not measured, as on CPU)."""

    name: str
    peak_allocated: int = 0
    peak_reserved: int = 0
    device_used: int = 0
    runs: int = 0
    measured: bool = False
    seconds: float = 0.0  # host wall time inside the phase, nested phases left out (where a run's time goes)

    def as_dict(self) -> dict[str, float | int | str]:
        """The record in GiB (measured figures only where CUDA measured them)."""
        out: dict[str, float | int | str] = {"phase": self.name, "runs": self.runs, "seconds": round(self.seconds, 3)}
        if self.measured:
            out.update(peak_allocated_gib=self.peak_allocated / GIB, peak_reserved_gib=self.peak_reserved / GIB,
                       device_used_gib=self.device_used / GIB)
        return out


def device_memory_used(device: int | None = None) -> int:
    """Bytes in use on the device as NVML reports them (all processes, CUDA context included).

    ``torch.cuda.device_memory_used`` asks NVML (or amdsmi); without it, ``mem_get_info`` gives the same
    figure as total minus free.
    """
    try:
        return int(torch.cuda.device_memory_used(device))
    except Exception:  # no NVML binding in this environment (pynvml missing): the driver's free figure
        free, total = torch.cuda.mem_get_info(device)
        return int(total - free)


class PhaseTracker:
    """Which phase is running, and each phase's measured peaks (see the module docstring).

    Args:
        cuda: Measure CUDA memory (default: when CUDA is initialised at a phase's entry).
    """

    def __init__(self, cuda: bool | None = None):
        self.cuda = cuda
        self.records: dict[str, PhaseRecord] = {}
        self._stack: list[str] = []
        self._since = 0.0  # when the innermost phase's time was last credited
        # Set by the run once the budget and the plan are known, for the out-of-memory line.
        self.budget_gib: float | None = None
        self.predicted: dict[str, dict[str, float]] = {}

    def reset(self) -> None:
        """Forget the records, budget and plan of an earlier run in this process (a run starts afresh)."""
        self.records.clear()
        self.budget_gib, self.predicted = None, {}

    @property
    def current(self) -> str | None:
        """The innermost phase running now, or None."""
        return self._stack[-1] if self._stack else None

    def _credit_time(self) -> None:
        """Credit the wall time since the last change of phase to the innermost phase (nested ones apart)."""
        now = time.perf_counter()
        if self._stack:
            self.records[self._stack[-1]].seconds += now - self._since
        self._since = now

    def _measuring(self) -> bool:
        if self.cuda is not None:
            return self.cuda
        return torch.cuda.is_available() and torch.cuda.is_initialized()

    def _fold(self, name: str) -> None:
        """Fold the peaks since the last reset into ``name``'s record, then reset them."""
        rec = self.records.setdefault(name, PhaseRecord(name))
        if not self._measuring():
            return
        rec.measured = True
        allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        # NVML gives no peak: what the device holds now plus what the allocator held above its current
        # reservation at its peak (the CUDA context and other processes do not move within a phase).
        device = device_memory_used(torch.cuda.current_device()) + reserved - torch.cuda.memory_reserved()
        rec.peak_allocated = max(rec.peak_allocated, allocated)
        rec.peak_reserved = max(rec.peak_reserved, reserved)
        rec.device_used = max(rec.device_used, device)
        torch.cuda.reset_peak_memory_stats()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[PhaseRecord]:
        """Measure ``name`` while the block runs; an out-of-memory error inside it is tagged with the phase.

        Example:
            >>> tracker = PhaseTracker(cuda=False)
            >>> with tracker.phase("export") as rec:
            ...     pass
            >>> rec.runs
            1
        """
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; phases are {', '.join(PHASES)}")
        if self._stack:
            self._fold(self._stack[-1])  # the enclosing phase's peak so far is its own, not this one's
        if self._measuring():
            if name in _RELEASE_CACHE:
                torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        rec = self.records.setdefault(name, PhaseRecord(name))
        self._credit_time()
        self._stack.append(name)
        try:
            yield rec
        except torch.OutOfMemoryError as exc:
            if getattr(exc, "neutrain_phase", None) is None:  # the innermost phase is where it happened
                exc.neutrain_phase = name
            raise
        finally:
            self._credit_time()
            self._stack.pop()
            rec.runs += 1
            self._fold(name)

    def table(self, predicted: dict[str, dict[str, float]] | None = None) -> str:
        """Measured (and predicted) peaks by phase, in GiB, in the order of :data:`PHASES`."""
        lines = [f"{'phase':<12}{'allocated':>10}{'reserved':>10}{'device':>10}{'predicted':>11}"]
        for name in PHASES:
            rec = self.records.get(name)
            if rec is None:
                continue
            pred = (predicted or {}).get(name, {}).get("reserved_gib")
            lines.append(f"{name:<12}{rec.peak_allocated / GIB:>10.2f}{rec.peak_reserved / GIB:>10.2f}"
                         f"{rec.device_used / GIB:>10.2f}{'' if pred is None else f'{pred:>11.2f}'}")
        return "\n".join(lines)


TRACKER = PhaseTracker()
"""The process's tracker: the run, the trainer's save and resume hooks and the OOM message share it."""


def phase(name: str):
    """``TRACKER.phase(name)``: measure a phase of this process's run (see :class:`PhaseTracker`).

    Example:
        >>> with phase("generate"):
        ...     current_phase()
        'generate'
    """
    return TRACKER.phase(name)


def current_phase() -> str | None:
    """The phase this process is in now (None outside any)."""
    return TRACKER.current


def out_of_memory_line(exc: BaseException, budget_gib: float | None = None,
                       predicted: dict[str, dict[str, float]] | None = None) -> str | None:
    """The one line for a device out-of-memory error anywhere in ``exc``'s chain, else None.

    Names the phase it happened in, the budget, the phase's peak measured up to the failure and the
    planner's prediction for that phase.

    Example:
        >>> exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        >>> exc.neutrain_phase = "save"
        >>> out_of_memory_line(exc, 14.5, {"save": {"reserved_gib": 12.3}})  # doctest: +ELLIPSIS
        "out of memory in phase 'save' under memory.device_budget_gib=14.5 (Tried to allocate 2.00 GiB; ...); the planner predicted 12.30 GiB..."
    """
    seen = set()
    while exc is not None and id(exc) not in seen and not isinstance(exc, torch.OutOfMemoryError):
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    if not isinstance(exc, torch.OutOfMemoryError):
        return None
    budget_gib = TRACKER.budget_gib if budget_gib is None else budget_gib
    predicted = TRACKER.predicted if predicted is None else predicted
    name = getattr(exc, "neutrain_phase", None) or TRACKER.current
    tried = re.search(r"[Tt]ried to allocate [\d.]+ ?[KMGT]?i?B", str(exc))
    what = tried.group(0) if tried else "an allocation failed"
    if name is None:  # outside a run's phases (another command): no budget or plan to name
        return f"out of memory on the device ({what})"
    rec = TRACKER.records.get(name)
    budget = f"memory.device_budget_gib={budget_gib:g}" if budget_gib else "no memory.device_budget_gib"
    peak = f"peak {rec.peak_allocated / GIB:.2f} GiB allocated, {rec.peak_reserved / GIB:.2f} GiB reserved" \
        if rec is not None and rec.peak_reserved else "peak not measured"
    line = f"out of memory in phase '{name}' under {budget} ({what}; {peak})"
    pred = (predicted or {}).get(name)
    if pred:
        line += f"; the planner predicted {pred['reserved_gib']:.2f} GiB reserved for it"
    # Setting a key by hand takes it out of the automatic fit's hands: the user's choice then stands.
    return line + ("; set memory.offload_activations or memory.offload_weights, or lower train.micro_batch_size"
                   if budget_gib else "; set memory.device_budget_gib (auto) to let the run choose what fits")
