"""Training callbacks: a metrics log file and the loss/memory plot.

``metrics.jsonl`` in the output directory gets one line per log event (loss,
learning rate, grad norm, tokens/s, peak memory), appended across resumes, so
the PNG written at the end of training covers the whole run.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from neutrain.errors import UserInputError
from neutrain.files import read_tail
from neutrain.storage.confine import check_output
from neutrain.storage.run_dir import claim

logger = logging.getLogger("neutrain")

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "training_curves.png"
_REPORTED: set[tuple[str, int]] = set()  # (file, line) warned about; line 0: unread, -1: cut
MAX_METRICS_BYTES = 32 << 20
"""How much of ``metrics.jsonl`` is read: its last 32 MiB, some 100,000 records (a few hundred bytes each)."""


class ChecksummedCheckpoint(TrainerCallback, ExportableState):
    """Records in each checkpoint's ``trainer_state.json`` that the checkpoint carries a checksum manifest.

    The Trainer saves every ``ExportableState`` callback's state under its class name; a checkpoint whose
    ``trainer_state.json`` names this class but has no manifest is refused as damaged
    (:func:`neutrain.storage.manifest.written_with_manifest`), whatever else was deleted with the manifest.
    Its state is empty: restoring it (``restore_callback_states_from_checkpoint``) changes nothing. The class
    name is :data:`~neutrain.storage.manifest.MANIFEST_MARK`: renaming it would unmark every checkpoint.
    """

    def state(self) -> dict:
        return {"args": {}, "attributes": {}}


class NoFinalSave(TrainerCallback):
    """``train.save_final: false``: no checkpoint at the last step unless it is a multiple of ``save_steps``.

    The Trainer saves at the last step whatever ``save_steps`` says; a benchmark that saves nothing needs a
    way to say so (and then needs no room on the disk).
    """

    def on_step_end(self, args, state, control, **kwargs):
        if state.max_steps and state.global_step >= state.max_steps and state.global_step % args.save_steps:
            control.should_save = False


class MetricsFileCallback(TrainerCallback):
    """Append every log event to ``<output_dir>/metrics.jsonl`` (main process only)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        record = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float, str))}}
        append_metrics(args.output_dir, [record])


def append_metrics(output_dir: str | os.PathLike, records: list[dict]) -> None:
    """Append ``records`` to ``<output_dir>/metrics.jsonl``, one line each, flushed to disk.

    The file must stay inside the run directory (:func:`~neutrain.storage.confine.check_output`).

    Example:
        >>> append_metrics("outputs/run", [{"step": 3, "loss": 2.5}])  # doctest: +SKIP
    """
    path = check_output(Path(output_dir) / METRICS_FILE, output_dir)
    claim(path)  # the run lists what it writes (neutrain.storage.run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as fh:
        # A line torn by a full disk has no newline: these records must not be glued to it.
        torn = fh.tell() > 0 and fh.seek(-1, os.SEEK_END) >= 0 and fh.read(1) != b"\n"
        fh.write((("\n" if torn else "") + "".join(json.dumps(r) + "\n" for r in records)).encode())
        fh.flush()
        os.fsync(fh.fileno())


class PlotCallback(TrainerCallback):
    """Plot loss (train and held-out), learning rate and peak memory per step to ``training_curves.png``.

    Drawn at the end of training and again after each evaluation, so the held-out loss of
    the evaluation that follows training is in the picture too. ``names``: what the two losses are
    (the trainer's ``loss_names``).
    """

    def __init__(self, names: tuple[str, str] = ("loss", "held-out loss")):
        self.names = names

    def _plot(self, args, state):
        if state.is_world_process_zero:
            out = args.output_dir
            claim(Path(out) / PLOT_FILE)
            plot_metrics(check_output(Path(out) / METRICS_FILE, out), check_output(Path(out) / PLOT_FILE, out), self.names)

    def on_train_end(self, args, state, control, **kwargs):
        self._plot(args, state)

    def on_evaluate(self, args, state, control, **kwargs):
        self._plot(args, state)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Records of a metrics file; for each step, the last record wins (a resumed run overwrites).

    A line that is not a record (torn by a full disk or a kill mid-write) is skipped with one
    warning naming the file and the line: one lost log line must not stop a resume, the
    summary or the export. Of a file over :data:`MAX_METRICS_BYTES` only its last part is read, and of one
    that is no regular file nothing, each with one warning.

    Example:
        >>> read_metrics("outputs/run/metrics.jsonl")[-1]["loss"]  # doctest: +SKIP
        2.31
    """
    if not os.path.lexists(path):
        return []
    # Only the tail: the file grows by a line per log event for as long as the run goes on, its readers (the plot)
    # want the latest steps most, and a plot of fewer of them is better than a run stopped at its end for want of
    # one. Not a regular file (a FIFO would block the read, a device never end it): no records, and a warning.
    try:
        data, start = read_tail(path, f"metrics file '{path}'", MAX_METRICS_BYTES, UserInputError)
    except UserInputError as exc:
        _warn_once(path, 0, "%s: no metrics read", exc)
        return []
    where = ""
    if start:
        data = data[data.find(b"\n") + 1:]  # the first line read is the end of one cut in two
        where = f" of its last {MAX_METRICS_BYTES >> 20} MiB"
        _warn_once(path, -1, "%s holds %s bytes: only its last %d MiB (%s records) are read, from step %s on", path,
                   f"{start + MAX_METRICS_BYTES:,}", MAX_METRICS_BYTES >> 20, data.count(b"\n"), _first_step(data))
    by_step: dict[tuple, dict] = {}
    for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        if line.strip():
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                _warn_once(path, number, "%s: line %d%s is not a complete metrics record (torn by a full disk or a "
                           "kill): skipped", path, number, where)
                continue
            # Phase memory records (neutrain.cli.memory) share the step of the run's end: one per phase.
            kind = "train" if "loss" in rec else ("eval" if "eval_loss" in rec else f"phase:{rec['phase']}" if "phase" in rec else "other")
            by_step[(kind, rec["step"])] = rec
    return [by_step[k] for k in sorted(by_step, key=lambda k: (k[1], k[0]))]


def _warn_once(path, key: int, message: str, *args) -> None:
    """Log ``message`` the first time for ``(path, key)``: the plot reads the file again after each evaluation."""
    if (str(path), key) not in _REPORTED:
        _REPORTED.add((str(path), key))
        logger.warning(message, *args)


def _first_step(data: bytes):
    for line in data.splitlines():
        try:
            return json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue
    return None


def plot_metrics(metrics_path: str | os.PathLike, png_path: str | os.PathLike,
                 names: tuple[str, str] = ("loss", "held-out loss")) -> str | None:
    """Draw loss (train, held-out), learning rate and peak memory side by side; returns the PNG path.

    None, and no file, when the metrics hold no training step: an evaluation alone (``neutrain eval``) is
    one number, which its own output prints; drawn, it was one point beside two empty panels.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = draw_metrics(read_metrics(metrics_path), names)
    if fig is None:
        return None
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return str(png_path)


def _legend_below(ax) -> None:
    """The axes' legend under its x label, outside the data: inside, "best" still covered a line that spans the
    whole width (a flat memory curve sat under the legend on the top border)."""
    labels = ax.get_legend_handles_labels()[1]
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1 if max(map(len, labels)) > 24 else 2, frameon=False)


def draw_metrics(everything: list[dict], names: tuple[str, str] = ("loss", "held-out loss")):
    """The figure of :func:`plot_metrics` for metrics records (:func:`read_metrics`); None without a training step."""
    import matplotlib.pyplot as plt

    records = [r for r in everything if "loss" in r]
    evals = [r for r in everything if "eval_loss" in r]
    if not records:
        return None
    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_lr, ax_mem) = plt.subplots(1, 3, figsize=(15, 4.4), layout="constrained")
    ax_loss.plot(steps, [r["loss"] for r in records], label=f"train {names[0]}" if names[0] == "loss" else names[0])
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label=names[1])
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    _legend_below(ax_loss)
    ax_loss.grid(alpha=0.3)
    lrs = [(r["step"], r["learning_rate"]) for r in records if isinstance(r.get("learning_rate"), (int, float))]
    if lrs:
        ax_lr.plot(*zip(*lrs), color="tab:green", label="learning rate")
        _legend_below(ax_lr)
    ax_lr.set_xlabel("step")
    ax_lr.set_ylabel("learning rate")
    ax_lr.grid(alpha=0.3)
    highest = 0.0
    for key, label in (("peak_memory_gib", "peak GPU allocated"), ("peak_reserved_gib", "peak GPU reserved"), ("peak_rss_gib", "peak process RSS")):
        values = [r.get(key) for r in records]
        drawn = [v for v in values if isinstance(v, (int, float)) and not math.isnan(v)]
        if drawn:
            ax_mem.plot(steps, [v if v is not None else math.nan for v in values], label=label)
            highest = max(highest, *drawn)
    ax_mem.set_xlabel("step")
    ax_mem.set_ylabel("GiB")
    # From 0: a run flat at 1.08 GiB looked like a 20x swing on a 0.02 GiB axis; with a fifth of headroom
    # above the highest point, so a flat line does not lie on the top border.
    ax_mem.set_ylim(bottom=0, top=highest * 1.2 if highest > 0 else None)
    if ax_mem.get_lines():  # a run that logged no memory (the draft's distillation) has no legend to draw
        _legend_below(ax_mem)
    ax_mem.grid(alpha=0.3)
    fig.suptitle("neutrain: loss, learning rate and memory")
    return fig
