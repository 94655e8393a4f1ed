"""Noise neutrain causes in other libraries, silenced narrowly: progress bars in logs, and one deprecation.

Why (a newcomer's first hour must not be buried in noise they cannot act on):

* **Progress bars in a log file.** tqdm redraws a bar with carriage returns; written to a file or a
  pipe (``neutrain ... > run.log``, CI), every redraw stays, and one line holds hundreds of bar states.
  When stderr is not a terminal, :func:`progress_bars_wanted` is false and :func:`quiet_progress_bars`
  turns off the bars of tqdm (through its ``TQDM_DISABLE`` variable, which child processes inherit),
  datasets and transformers; neutrain's own log lines (one per logging step) still print.
* **peft's FutureWarning.** ``get_peft_model`` reads ``model.is_gradient_checkpointing``, which
  transformers 5 deprecates in favour of ``is_activation_checkpointing``: every LoRA run printed
  "`is_gradient_checkpointing` is deprecated". :func:`peft_wrapping` ignores that one message, only
  while neutrain calls peft.

Example:
    >>> import io
    >>> progress_bars_wanted(io.StringIO(), environ={})  # a pipe or a file: no bars
    False
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator, MutableMapping
from typing import IO

PEFT_CHECKPOINTING_WARNING = r"`is_gradient_checkpointing` is deprecated"


def progress_bars_wanted(stream: IO | None = None, environ: MutableMapping[str, str] = os.environ) -> bool:
    """True when progress bars help: stderr is a terminal and neither ``DISABLE_TQDM`` nor ``TQDM_DISABLE`` is set."""
    if environ.get("DISABLE_TQDM") == "1" or environ.get("TQDM_DISABLE", "").lower() in {"1", "true"}:
        return False
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def quiet_progress_bars(stream: IO | None = None, environ: MutableMapping[str, str] = os.environ) -> bool:
    """Turn progress bars off when :func:`progress_bars_wanted` says they would only litter a log; returns
    whether bars stay on. A user's own ``TQDM_DISABLE`` is left alone."""
    if progress_bars_wanted(stream, environ):
        return True
    environ.setdefault("TQDM_DISABLE", "1")  # tqdm reads TQDM_<arg> as the default of each bar's argument
    # datasets and huggingface_hub (whose setting transformers follows) read these once, when imported; a
    # library imported already is told directly. Nothing is imported here: a recipe error stays instant.
    environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    if "transformers.utils.logging" in sys.modules:
        sys.modules["transformers.utils.logging"].disable_progress_bar()
    return False


@contextlib.contextmanager
def peft_wrapping() -> Iterator[None]:
    """Around neutrain's calls into peft: transformers' deprecation of ``is_gradient_checkpointing``, which
    peft reads, is not shown (nothing a user can change); every other warning is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=PEFT_CHECKPOINTING_WARNING, category=FutureWarning)
        yield
