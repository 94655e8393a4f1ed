"""The KV-cache benchmark's time plan: every part of ``--part all`` gets its seconds up front, printed first.

One device call holds everything (``benchmarks/kv/gpu_kv.sh``). The plan gives each throughput row a cap (its build,
two warm-up steps, its timed steps and the profiled step), the retrieval model's evaluation and the real model
their estimates, and the retrieval model's training what is left; the pinned host buffer is filled beside the
training.

No row is skipped for time. A row's cap bounds its timed steps: a row whose warm-up shows that its steps do not
fit takes fewer (at least one; ``MIN_STEPS`` when they are cheap) and records ``steps_cut``. A run behind the plan
when a row starts gives each row left its share of what is left before the later parts' seconds (``cap``), so
that no row is starved by those before it; what a row cannot shrink (its build, the warm-up, one timed step and
the profiled step) comes out of the accuracy parts' seconds, whose settings beside the rows come first.

Calibration: the H200 call at bdfe903 (benchmarks/kv/results.jsonl#kv_eval, Llama-3-8B shapes, the batches the rows
size). Its rows, in seconds at 32K / 64K (build + 2 warm-up + timed + 1 profiled step): full 4.2 / 3.5 (four
timings of ~38 ms steps), ShadowKV 3.8 / 3.6 (128 / 172 ms, + the step split), MiniCache merge + 4-bit
15.0 / 14.7 (builds of 13 s at batch 126 / 64, 291 ms steps), 4-bit only 8.4 / 9.9 (7-8 s builds, 252 / 282 ms),
merge 7.9 / 10.3 with 6 steps (5-7 s builds, 331 / 336 ms), the pruned cache 2.2 / 2.3, the full cache again
2.2 / 3.3, the restore path 11.9 / 14.0 with 3 / 4 steps (5-6 s builds, 1.09 s steps); QuantizedCache did not
run there (its H100 rows: 8.9 / 8.7 s at 0.83 s a step and batch 35 / 17; ~twice the batch on the H200). From
the plan's start to the first row the call spent ~40-50 s besides the training (the trainer's start, the 8B
model on the GPU, the gaps between rows); the retrieval model's settings beside the rows ~72 s (the reference,
the merge plan, 8 settings of 4-16 s); the real model ~27 s to load, run the full cache and its merge plan, then
4-9 s a setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_STEPS = 3
"""Timed decode steps a row gets when its cap has room for them (and always when they take under
``CHEAP_STEPS_SECONDS`` together): the figure is their median."""
CHEAP_STEPS_SECONDS = 1.0

# Row -> seconds at (32K, 64K): build + 2 warm-up + timed + 1 profiled step, from the H200 log at bdfe903 (above).
# Cheap rows with --steps (6) timed steps (the full cache timed four times: the dispatcher's choice and three forced
# backends), the MiniCache rows with MIN_STEPS, the slow rows last with 2 (the restore path's 1.1 s steps; the
# QuantizedCache from its H100 rows at the H200's batch).
ROW_SECONDS = {
    "full": (5, 4), "shadowkv": (4, 4), "shadowkv_fused_decode": (4, 4),
    "shadowkv_fused_decode_store_reads": (4, 4), "kvpress_pruned": (3, 3), "minicache_merge_4bit": (16, 16),
    "minicache_4bit_only": (9, 10), "minicache_merge": (8, 10), "full_repeat": (3, 4),
    "quantized_cache_4bit": (14, 14), "minicache_merge_4bit_restore": (11, 12),
    # Not yet measured: as the rows they capture, the full cache's with its four captures (one per SDPA choice).
    "full_graph": (5, 4), "shadowkv_fused_graph": (4, 4),
}
ROW_GAP_SECONDS = 0.5  # between rows: the failed or finished cache released, the row logged
SETUP_SECONDS = 35  # the retrieval model and its trainer's start, the 8B model on the GPU
ACCURACY_SECONDS = 80  # the retrieval model's reference, merge plan and the 8 settings beside the rows, 12 + 12 prompts
REAL_SECONDS = 80  # SmolLM2 on the GPU: load, the full cache, the merge plan, the 8 settings beside the rows, 10 prompts
CLOSE_SECONDS = 10  # targets and the record
PIN_GIB_PER_SECOND = 2.25  # d100cd9: 64 GiB in 28.4 s
MIN_TRAIN_SECONDS = 60
TRAIN_NEEDED_SECONDS = 130
"""The retrieval model's training at bdfe903: 91.7% for the full cache (the 90% gate) after 131 s (2,010 steps);
it first retrieved at ~1,200 steps (83 s). A plan that leaves less says so."""


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
        return sum(self.rows.values()) + ROW_GAP_SECONDS * len(self.rows)

    def after_rows(self) -> float:
        """Seconds the parts after the throughput rows keep: the rows must leave them."""
        return self.accuracy + self.real + self.close

    def cap(self, row: tuple[str, int], later: list[tuple[str, int]], seconds_left: float) -> float:
        """The running ``row``'s seconds, with ``later`` rows still to come and ``seconds_left`` in the run: its
        planned seconds while the rows keep to the plan, else its share of what is left before the later parts'
        seconds (none when nothing is: the row still gets one timed step)."""
        planned = self.rows.get(row, 0.0)
        remaining = planned + sum(self.rows.get(r, 0.0) for r in later)
        room = seconds_left - self.after_rows() - ROW_GAP_SECONDS * (1 + len(later))
        if room >= remaining or remaining <= 0:
            return planned
        return max(0.0, planned * room / remaining)

    def lines(self) -> list[str]:
        """The plan as printed at the start of the run, a part a line (``plan: <part> <seconds>``)."""
        total = self.setup + self.train + self.throughput + self.accuracy + self.real + self.close
        out = [f"time plan: {self.budget:.0f} s budget, {total:.0f} s planned",
               f"plan: setup {self.setup:.0f}",
               f"plan: retrieval model training {self.train:.0f} (the host buffer pinned beside it, ~{self.pin:.0f})"]
        if self.train < TRAIN_NEEDED_SECONDS:
            out.append(f"plan: warning: the training's {self.train:.0f} s is under the {TRAIN_NEEDED_SECONDS} s the "
                       "retrieval model took to pass the 90% gate on the H200 (bdfe903); more: CALL_SECONDS")
        out += [f"plan: ctx {ctx} {label} {s:.0f}" for (label, ctx), s in self.rows.items()]
        out += [f"plan: throughput rows {self.throughput:.0f} (with {ROW_GAP_SECONDS} s between rows)",
                f"plan: retrieval-model settings {self.accuracy:.0f}",
                f"plan: real model {self.real:.0f}", f"plan: record {self.close:.0f}"]
        return out


def row_seconds(label: str, ctx: int) -> float:
    """A row's cap: its estimate at 32K for contexts up to 32K, at 64K above."""
    short, long = ROW_SECONDS.get(label, (10, 10))
    return short if ctx <= 32768 else long


def time_plan(budget: float, labels, contexts, real_here: bool, host_gib: float, train_max: float) -> TimePlan:
    """The plan for ``budget`` seconds: each row (every label at every context, in the order they run) its cap,
    the accuracy parts their estimates, and the training the rest, between ``MIN_TRAIN_SECONDS`` and
    ``train_max``."""
    rows = {(label, ctx): float(row_seconds(label, ctx)) for label in labels for ctx in contexts}
    plan = TimePlan(budget=budget, train=0.0, rows=rows, real=REAL_SECONDS if real_here else 0.0,
                    pin=host_gib / PIN_GIB_PER_SECOND)
    rest = budget - plan.setup - plan.throughput - plan.after_rows()
    plan.train = max(MIN_TRAIN_SECONDS, min(train_max, rest))
    return plan
