"""Training callbacks: a metrics log file and the loss/memory plot.

``metrics.jsonl`` in the output directory gets one line per log event (loss,
learning rate, grad norm, tokens/s, peak memory), appended across resumes, so
the PNG written at the end of training covers the whole run.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from transformers import TrainerCallback

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "training_curves.png"


class MetricsFileCallback(TrainerCallback):
    """Append every log event to ``<output_dir>/metrics.jsonl`` (main process only)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        record = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float, str))}}
        path = Path(args.output_dir) / METRICS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()
            os.fsync(fh.fileno())


class PlotCallback(TrainerCallback):
    """Plot loss (train and held-out), learning rate and peak memory per step to ``training_curves.png``.

    Drawn at the end of training and again after each evaluation, so the held-out loss of
    the evaluation that follows training is in the picture too.
    """

    def _plot(self, args, state):
        if state.is_world_process_zero:
            plot_metrics(Path(args.output_dir) / METRICS_FILE, Path(args.output_dir) / PLOT_FILE)

    def on_train_end(self, args, state, control, **kwargs):
        self._plot(args, state)

    def on_evaluate(self, args, state, control, **kwargs):
        self._plot(args, state)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Records of a metrics file; for each step, the last record wins (a resumed run overwrites)."""
    if not Path(path).exists():
        return []
    by_step: dict[tuple, dict] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            kind = "train" if "loss" in rec else ("eval" if "eval_loss" in rec else "other")
            by_step[(kind, rec["step"])] = rec
    return [by_step[k] for k in sorted(by_step, key=lambda k: (k[1], k[0]))]


def plot_metrics(metrics_path: str | os.PathLike, png_path: str | os.PathLike) -> str | None:
    """Draw loss (train, held-out), learning rate and peak memory side by side; returns the PNG path (None: no data)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    everything = read_metrics(metrics_path)
    records = [r for r in everything if "loss" in r]
    evals = [r for r in everything if "eval_loss" in r]
    if not records and not evals:
        return None
    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_lr, ax_mem) = plt.subplots(1, 3, figsize=(15, 4))
    if records:
        ax_loss.plot(steps, [r["loss"] for r in records], label="train loss")
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="held-out loss")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    lrs = [(r["step"], r["learning_rate"]) for r in records if isinstance(r.get("learning_rate"), (int, float))]
    if lrs:
        ax_lr.plot(*zip(*lrs), color="tab:green", label="learning rate")
        ax_lr.legend()
    ax_lr.set_xlabel("step")
    ax_lr.set_ylabel("learning rate")
    ax_lr.grid(alpha=0.3)
    for key, label in (("peak_memory_gib", "peak GPU allocated"), ("peak_reserved_gib", "peak GPU reserved"), ("peak_rss_gib", "peak process RSS")):
        values = [r.get(key) for r in records]
        if any(v is not None and not (isinstance(v, float) and math.isnan(v)) for v in values):
            ax_mem.plot(steps, values, label=label)
    ax_mem.set_xlabel("step")
    ax_mem.set_ylabel("GiB")
    ax_mem.set_ylim(bottom=0)  # from 0: a run flat at 1.08 GiB looked like a 20x swing on a 0.02 GiB axis (issue 34)
    if ax_mem.get_lines():  # a run that logged no memory (the draft's distillation) has no legend to draw
        ax_mem.legend()
    ax_mem.grid(alpha=0.3)
    fig.suptitle("neutrain: loss, learning rate and memory")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return str(png_path)
