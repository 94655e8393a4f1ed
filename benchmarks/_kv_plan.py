"""The KV-cache benchmark's time plan: every part of ``--part all`` gets its seconds up front, printed first.

One device call holds everything (``benchmarks/gpu_kv.sh``). The H200 run at d100cd9 spent its budget in
order and skipped what came last (full_repeat, the restore path, QuantizedCache, MiniCache merge at 64K) and
the real model. The plan gives each throughput row a cap (its build, a warm-up step, at least
``MIN_STEPS`` timed steps and the profiled step), the retrieval model's evaluation and the real model their
estimates, and the retrieval model's training what is left; the pinned host buffer is filled beside the
training. A cut-off run shows in the printed plan where its time went.

The estimates are seconds on one H200 (Llama-3-8B shapes, the batches the rows size), from the runs at
4425da9 and d100cd9: a row's build (a random prefill of ~110 GiB: 4-6 s for a MiniCache, none for the full
cache) plus its steps (38-55 ms full, 110-200 ms ShadowKV and the pruned cache, ~300 ms fused MiniCache, ~0.95 s
MiniCache's restore path, ~1.7 s QuantizedCache).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_STEPS = 3
"""Timed decode steps every row gets, whatever its cap: the figure is their median."""

# Row -> estimated seconds at (32K, 64K): build + warm-up + timed steps (at most --steps, at least MIN_STEPS) +
# the profiled step. The full cache is timed four times (the dispatcher's choice and three forced backends).
ROW_SECONDS = {
    "full": (6, 6), "shadowkv": (5, 4), "minicache_merge_4bit": (8, 10), "kvpress_pruned": (3, 3),
    "minicache_4bit_only": (7, 9), "minicache_merge": (10, 13), "full_repeat": (3, 3),
    "minicache_merge_4bit_restore": (10, 13), "quantized_cache_4bit": (12, 12),
}
SETUP_SECONDS = 25  # imports, the CUDA context, the retrieval model, the 8B model on the GPU
ACCURACY_SECONDS = 110  # the retrieval model's settings beside the rows, 12 + 12 prompts each (d100cd9: 100 s)
REAL_SECONDS = 60  # SmolLM2 on the GPU: load, the merge plan, the settings beside the rows on 10 prompts
CLOSE_SECONDS = 10  # targets and the record
PIN_GIB_PER_SECOND = 2.25  # d100cd9: 64 GiB in 28.4 s
MIN_TRAIN_SECONDS = 60


@dataclass
class TimePlan:
    """Seconds for each part of one ``--part all`` run, in the order they run."""

    budget: float
    train: float
    rows: dict[tuple[str, int], float] = field(default_factory=dict)
    setup: float = SETUP_SECONDS
    accuracy: float = ACCURACY_SECONDS
    real: float = 0.0
    close: float = CLOSE_SECONDS
    pin: float = 0.0

    @property
    def throughput(self) -> float:
        return sum(self.rows.values())

    def after_rows(self) -> float:
        """Seconds the parts after the throughput rows keep: the rows must leave them."""
        return self.accuracy + self.real + self.close

    def lines(self) -> list[str]:
        """The plan as printed at the start of the run, a part a line (``plan: <part> <seconds>``)."""
        total = self.setup + self.train + self.throughput + self.accuracy + self.real + self.close
        out = [f"time plan: {self.budget:.0f} s budget, {total:.0f} s planned",
               f"plan: setup {self.setup:.0f}",
               f"plan: retrieval model training {self.train:.0f} (the host buffer pinned beside it, ~{self.pin:.0f})"]
        out += [f"plan: ctx {ctx} {label} {s:.0f}" for (label, ctx), s in self.rows.items()]
        out += [f"plan: throughput rows {self.throughput:.0f}", f"plan: retrieval-model settings {self.accuracy:.0f}",
                f"plan: real model {self.real:.0f}", f"plan: record {self.close:.0f}"]
        return out


def row_seconds(label: str, ctx: int) -> float:
    """A row's cap: its estimate at 32K for contexts up to 32K, at 64K above."""
    short, long = ROW_SECONDS.get(label, (10, 10))
    return short if ctx <= 32768 else long


def time_plan(budget: float, labels, contexts, real_here: bool, host_gib: float, train_max: float) -> TimePlan:
    """The plan for ``budget`` seconds: each row (every label at every context) its cap, the accuracy parts their
    estimates, and the training the rest, between ``MIN_TRAIN_SECONDS`` and ``train_max``."""
    rows = {(label, ctx): float(row_seconds(label, ctx)) for label in labels for ctx in contexts}
    plan = TimePlan(budget=budget, train=0.0, rows=rows, real=REAL_SECONDS if real_here else 0.0,
                    pin=host_gib / PIN_GIB_PER_SECOND)
    rest = budget - plan.setup - plan.throughput - plan.after_rows()
    plan.train = max(MIN_TRAIN_SECONDS, min(train_max, rest))
    return plan
