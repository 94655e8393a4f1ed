"""``NeuTrainer``: the ``transformers.Trainer`` subclass users run and subclass.

It works with standard ``TrainingArguments`` and adds what neutrain users expect
from every run:

* per-step logs of loss, learning rate, tokens/s and peak memory (GPU allocated
  and reserved, or process RSS on the CPU), through the normal ``Trainer.log``
  path, so ``report_to="tensorboard"`` records them too;
* ``metrics.jsonl`` and a loss/memory PNG in ``output_dir``;
* atomic checkpoints: ``checkpoint-N`` is written to a temporary directory and
  renamed into place, so a run killed while saving leaves the previous
  checkpoint intact, and ``resume_from_checkpoint`` continues exactly.

Example:
    >>> from transformers import TrainingArguments
    >>> from neutrain import NeuTrainer
    >>> class MyTrainer(NeuTrainer):
    ...     def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    ...         return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
    >>> trainer = MyTrainer(model=model, args=TrainingArguments("out", max_steps=10), train_dataset=ds)
    >>> trainer.train()
"""

from __future__ import annotations

import os
import resource
import shutil
import sys
import time
from typing import Any

import torch
from transformers import Trainer

from neutrain import compat
from neutrain.callbacks import MetricsFileCallback, PlotCallback

TMP_PREFIX = ".tmp-"


def peak_memory_stats() -> dict[str, float]:
    """Peak memory so far: GPU allocated/reserved GiB when CUDA is used, else process RSS GiB."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        }
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"peak_rss_gib": rss / (2**30 if sys.platform == "darwin" else 2**20)}


class NeuTrainer(Trainer):
    """A ``transformers.Trainer`` with neutrain's logging, plots and atomic checkpoints.

    Args:
        *args: As for ``transformers.Trainer``.
        memory: The recipe's ``memory`` section (weights, fused-update options); ``None`` means dense defaults.
        **kwargs: As for ``transformers.Trainer``.
    """

    def __init__(self, *args, memory: dict[str, Any] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.memory = dict(memory or {})
        self._tokens_since_log = 0
        self._last_log_time: float | None = None
        self.add_callback(MetricsFileCallback())
        self.add_callback(PlotCallback())

    # ---- logging -------------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._last_log_time is None:
            self._last_log_time = time.perf_counter()
        ids = inputs.get("input_ids")
        if ids is not None:
            mask = inputs.get("attention_mask")
            self._tokens_since_log += int(mask.sum()) if mask is not None else ids.numel()
        return super().training_step(model, inputs, num_items_in_batch)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs:
            now = time.perf_counter()
            if self._last_log_time is not None and now > self._last_log_time:
                # Global throughput: every process sees its own shard of the batch.
                logs["tokens_per_second"] = self._tokens_since_log * self.args.world_size / (now - self._last_log_time)
            self._tokens_since_log, self._last_log_time = 0, now
            logs.update(peak_memory_stats())
        super().log(logs, *args, **kwargs)

    # ---- checkpoints ---------------------------------------------------------------------

    def _save_checkpoint(self, model, trial) -> None:
        """Write ``checkpoint-N`` into a temporary directory, then rename it into place.

        Why: ``Trainer`` writes straight into ``checkpoint-N``; a run killed halfway
        leaves a directory that ``get_last_checkpoint`` picks up and cannot resume.
        Rotation of old checkpoints happens only after the rename.
        """
        run_dir = self._get_output_dir(trial=trial)
        name = f"checkpoint-{self.state.global_step}"
        tmp_run_dir = os.path.join(run_dir, f"{TMP_PREFIX}{name}")
        if self.args.should_save and os.path.isdir(tmp_run_dir):
            shutil.rmtree(tmp_run_dir)  # leftovers of a run killed while saving
        if self.args.world_size > 1:
            self.args.distributed_state.wait_for_everyone()
        self._get_output_dir = lambda trial=None: tmp_run_dir  # type: ignore[method-assign]
        try:
            super()._save_checkpoint(model, trial)
        finally:
            del self._get_output_dir
        if self.args.world_size > 1:
            self.args.distributed_state.wait_for_everyone()
        if self.args.should_save:
            final = os.path.join(run_dir, name)
            if os.path.isdir(final):  # re-saving the same step: keep the old one until the new one is in place
                old = os.path.join(run_dir, f"{TMP_PREFIX}old-{name}")
                os.replace(final, old)
                os.replace(os.path.join(tmp_run_dir, name), final)
                shutil.rmtree(old)
            else:
                os.replace(os.path.join(tmp_run_dir, name), final)
            _fsync_dir(run_dir)
            shutil.rmtree(tmp_run_dir, ignore_errors=True)
            if self.state.best_model_checkpoint and self.state.best_model_checkpoint.startswith(tmp_run_dir):
                self.state.best_model_checkpoint = final
            compat.rotate_checkpoints(self, run_dir)
        if self.args.world_size > 1:
            self.args.distributed_state.wait_for_everyone()


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
