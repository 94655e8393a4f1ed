"""What a run prints while it trains: labelled progress bars and one readable line per log event.

Why not transformers' ``ProgressCallback``: its bars carry no label (a run shows five of
them: training, evaluation, the draft's training...), and it prints each log event as a
dict of strings (``{'loss': '8.003', ...}``). Here every bar says what it counts, and a log
event is one line of numbers with units. Also, a run whose ``max_steps`` is not a multiple
of ``logging_steps`` (or is smaller) still logs its last step, so the loss line, the
metrics file and the PNG always cover the end of training.

Example:
    >>> format_log_line({"loss": 8.0027, "learning_rate": 0.08, "grad_norm": 3.66, "tokens_per_second": 153.5,
    ...                  "peak_rss_gib": 1.097, "epoch": 0.004}, step=5, max_steps=60)
    'step 5/60  loss 8.003  lr 0.08  grad norm 3.66  154 tokens/s  RSS 1.10 GiB'
"""

from __future__ import annotations

import math
import time

from tqdm.auto import tqdm
from transformers import TrainerCallback

from neutrain.optim.nonfinite import NONFINITE_KEY


def _num(value: float) -> str:
    return "nan" if isinstance(value, float) and math.isnan(value) else f"{value:.4g}"


def mark_skipped_window(logs: dict, log_history: list[dict], step: int) -> None:
    """Say in a loss record that steps it covers were skipped for a non-finite loss or gradient.

    ``logs`` carries the run's ``nonfinite_skipped_steps`` so far; the previous loss record in ``log_history``
    (restored with the log on a resume) opens the window. Adds ``nonfinite_in_window``; when every step of the
    window was skipped, the loss is logged as NaN and the computed one kept as ``skipped_loss``.

    Why: a step skipped for a non-finite gradient has a finite loss, and its record looked like a step that
    trained; the log is read as the history of the weights.

    Example:
        >>> logs = {"loss": 2.5, "nonfinite_skipped_steps": 1}
        >>> mark_skipped_window(logs, [{"step": 2, "loss": 2.7, "nonfinite_skipped_steps": 0}], step=3)
        >>> logs["nonfinite_in_window"], logs["loss"], logs["skipped_loss"]
        (1, nan, 2.5)
    """
    last = next((h for h in reversed(log_history) if "loss" in h), {})
    in_window = logs.get(NONFINITE_KEY, 0) - last.get(NONFINITE_KEY, 0)
    if in_window <= 0:
        return
    logs["nonfinite_in_window"] = in_window
    if in_window >= step - last.get("step", 0) and math.isfinite(logs["loss"]):
        logs["skipped_loss"], logs["loss"] = logs["loss"], float("nan")


def format_log_line(logs: dict, step: int, max_steps: int, first_step: int = 0,
                    names: tuple[str, str] = ("loss", "held-out loss"), stage: str | None = None) -> str:
    """One log event as a line: the step, then loss, held-out loss, learning rate, grad norm, speed and memory.

    Empty when the event carries none of these (e.g. only evaluation timings). ``first_step``: the step this
    launch started from (a resumed run's checkpoint step). ``names``: what the training and the held-out loss
    are (a draft's are distillation losses, not comparable with its target's cross-entropy).

    Example:
        >>> format_log_line({"train_runtime": 258.1, "train_loss": 2.685}, step=5, max_steps=5, first_step=4)
        'step 5/5  training done in 258.1 s, mean train loss 13.43 (step 5)'
    """
    # Before training (an evaluation first, as the draft's distillation does) the Trainer knows no step
    # count yet: "step 0/0" read as a broken run to a new user.
    # ``stage`` names what is evaluated when nothing trains (`neutrain eval` of a trained checkpoint): "before
    # training" said the opposite of the truth there.
    parts = [stage or ("before training" if step == 0 and not max_steps else f"step {step}/{max_steps}")]
    if "train_runtime" in logs:
        loss, steps = logs.get("train_loss", float("nan")), ""
        if 0 < first_step < step:
            # The Trainer divides this launch's summed losses by every step since the start of the run, the
            # resumed ones too: one step after a resume at 4 read 2.685 for a loss of 13.43 (the 70B recipe).
            loss = loss * step / (step - first_step)
            steps = f" (step {step})" if step - first_step == 1 else f" (steps {first_step + 1}-{step})"
        name = "train loss" if names[0] == "loss" else names[0]
        return f"{parts[0]}  training done in {logs['train_runtime']:.1f} s, mean {name} {_num(loss)}{steps}"
    if "loss" in logs:
        parts.append(f"{names[0]} {_num(logs['loss'])}")
    if "eval_loss" in logs:
        parts.append(f"{names[1]} {_num(logs['eval_loss'])}")
    if "eval_acceptance" in logs:
        parts.append(f"acceptance alpha {logs['eval_acceptance']:.3f}")
    if "learning_rate" in logs:
        parts.append(f"lr {_num(logs['learning_rate'])}")
    if logs.get("grad_norm") is not None:
        parts.append(f"grad norm {_num(logs['grad_norm'])}")
    if "tokens_per_second" in logs:
        parts.append(f"{logs['tokens_per_second']:.0f} tokens/s")
    if logs.get("peak_memory_gib") is not None:
        parts.append(f"GPU {logs['peak_memory_gib']:.2f} GiB allocated, {logs.get('peak_reserved_gib', float('nan')):.2f} reserved")
    elif logs.get("peak_rss_gib") is not None:
        parts.append(f"RSS {logs['peak_rss_gib']:.2f} GiB")
    if logs.get("nonfinite_in_window"):
        parts.append(f"SKIPPED (non-finite loss or gradient: {logs['nonfinite_in_window']} step(s) here changed no weight)")
    if logs.get("nonfinite_skipped_steps"):
        parts.append(f"{logs['nonfinite_skipped_steps']} non-finite steps skipped")
    return "  ".join(parts) if len(parts) > 1 else ""


def format_duration(seconds: float) -> str:
    """A duration as a log line shows it: ``45s``, ``3m05s``, ``2h07m``.

    Example:
        >>> format_duration(44.6), format_duration(185), format_duration(7620)
        ('45s', '3m05s', '2h07m')
    """
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def timing_suffix(elapsed: float, step: int, first_step: int, max_steps: int) -> str:
    """``elapsed 3m05s  ETA 1m10s`` for a training line written without a progress bar (a log file, a pipe).

    The rate is this launch's: steps since ``first_step`` (a resumed run's checkpoint) over the time since its
    training began. No ETA before a step is done or once the last one is.

    Example:
        >>> timing_suffix(60.0, step=30, first_step=10, max_steps=50)
        'elapsed 1m00s  ETA 1m00s'
    """
    text = f"elapsed {format_duration(elapsed)}"
    done = step - first_step
    if done > 0 and 0 < step < max_steps:
        text += f"  ETA {format_duration(elapsed / done * (max_steps - step))}"
    return text


class LabelledProgressCallback(TrainerCallback):
    """Progress bars named after what they count (``label`` for training, "held-out eval"), and readable log lines.

    A resumed run's bar starts at the checkpoint's step. Without bars (stderr is a log file or a pipe), each
    training line carries the elapsed time and an ETA instead, which the bar would have shown.
    """

    def __init__(self, label: str = "training", bars: bool = True, names: tuple[str, str] = ("loss", "held-out loss"),
                 stage: str | None = None):
        self.label, self.bars, self.names = label, bars, names
        self.stage = stage  # what the log lines are of when nothing trains (see format_log_line)
        self.training_bar = None
        self.prediction_bar = None
        self.current_step = 0
        self.first_step = 0  # the step this launch started from (a resumed run's)
        self.started: float | None = None  # when this launch's training began (monotonic clock)

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.bars:
            # From the resumed step: a bar back at 0/200 read as a run that had lost its checkpoint.
            self.training_bar = tqdm(total=state.max_steps, initial=state.global_step, desc=self.label, unit="step",
                                     dynamic_ncols=True)
        self.current_step = self.first_step = state.global_step
        self.started = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        if state.max_steps and state.global_step >= state.max_steps:
            control.should_log = True  # the last step is always logged, whatever logging_steps says
        if self.training_bar is not None:
            self.training_bar.update(state.global_step - self.current_step)
            self.current_step = state.global_step

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if state.is_world_process_zero and self.bars and eval_dataloader is not None and hasattr(eval_dataloader, "__len__"):
            if self.prediction_bar is None:
                self.prediction_bar = tqdm(total=len(eval_dataloader), desc="held-out eval", unit="batch",
                                           leave=self.training_bar is None, dynamic_ncols=True)
            self.prediction_bar.update(1)

    def _close_prediction_bar(self):
        if self.prediction_bar is not None:
            self.prediction_bar.close()
        self.prediction_bar = None

    def on_evaluate(self, args, state, control, **kwargs):
        self._close_prediction_bar()

    def on_predict(self, args, state, control, **kwargs):
        self._close_prediction_bar()

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        line = format_log_line(logs, state.global_step, state.max_steps, self.first_step, self.names, self.stage)
        if line and "loss" in logs and not self.bars and self.started is not None:
            line += "  " + timing_suffix(time.monotonic() - self.started, state.global_step, self.first_step, state.max_steps)
        if state.is_world_process_zero and line:  # an event with none of these numbers prints nothing
            (self.training_bar.write if self.training_bar is not None else tqdm.write)(line)

    def on_train_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            self.training_bar.close()
            self.training_bar = None
