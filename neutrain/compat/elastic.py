"""torch.distributed.elastic (``torchrun``, ``accelerate launch``) after a launched process refused its input.

Why: a process of a launch that refuses its recipe, data or launch says one line and exits 2, and the
launcher's agent takes every non-zero exit for a crash: it raises ``ChildFailedError`` and Python prints
its traceback and a forty-line failure report under neutrain's line. No exit status avoids that, and no
neutrain code runs in the launcher unless put there. So each half is done where it runs:

* in the launched process, :func:`record_refusal` writes the line to the error file the agent hands it
  (``TORCHELASTIC_ERROR_FILE``, in the format torch's own ``ErrorHandler`` writes), marked as neutrain's,
  with whether this process printed it: one process of a launch prints it (the first), the others only
  record it. A launcher without the hook below still shows the line in its report, where it said
  "To enable traceback see ...";
* in the launcher, ``neutrain-recipe.pth`` (:data:`neutrain.config.recipe_codec.PTH_LINE`) installs an
  ``sys.excepthook`` that hands a ``ChildFailedError`` to :func:`excepthook`: when every failure is such
  a refusal, or a process the agent stopped after one, it prints the lines no process printed, and no
  traceback; the launcher exits 1. Any other failure gets the report as before.

torch 2.6 to 2.13 read the error file the same way (``ProcessFailure``); the hook reads only the failures'
``exitcode`` and ``error_file_data``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Mapping

MARK = "neutrain_refusal"
"""The error file's key that says the failure is a refusal neutrain put in one line."""

STOPPED = -signal.SIGTERM
"""The exit code of a process the agent stopped once another one failed."""


def error_file(environ: Mapping[str, str] = os.environ) -> str | None:
    """The error file torch elastic's agent gave this process, or None outside such a launch."""
    return environ.get("TORCHELASTIC_ERROR_FILE") or None


def record_refusal(line: str, said: bool, environ: Mapping[str, str] = os.environ) -> None:
    """Write the refusal ``line`` (as printed, prefix included) to this process's elastic error file, if any.

    Example:
        >>> import tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "error.json")
        >>> record_refusal("neutrain: error: train.max_steps: 0 trains nothing", True, {"TORCHELASTIC_ERROR_FILE": path})
        >>> json.load(open(path))["message"]["message"]
        'neutrain: error: train.max_steps: 0 trains nothing'
    """
    path = error_file(environ)
    if path is None:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}},
            MARK: {"said": said}}
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)
    except OSError:
        pass  # the launcher's report then says less; the refusal itself stands


def unsaid_refusals(failures: Mapping) -> list[str] | None:
    """The refusal lines of a launch's failures that no process printed, each once; None when a failure is
    not a neutrain refusal (nor a process stopped after one): that one's report is the launcher's to print.

    Example:
        >>> from types import SimpleNamespace as F
        >>> said = {"message": {"message": "neutrain: error: x"}, MARK: {"said": True}}
        >>> other = {"message": {"message": "neutrain: error: y"}, MARK: {"said": False}}
        >>> unsaid_refusals({0: F(exitcode=2, error_file_data=said), 1: F(exitcode=STOPPED, error_file_data={})})
        []
        >>> unsaid_refusals({0: F(exitcode=2, error_file_data=said), 1: F(exitcode=2, error_file_data=other)})
        ['neutrain: error: y']
        >>> unsaid_refusals({0: F(exitcode=1, error_file_data={"message": "<NONE>"})}) is None
        True
    """
    said, unsaid = set(), []
    for failure in failures.values():
        data = getattr(failure, "error_file_data", None)
        mark = data.get(MARK) if isinstance(data, dict) else None
        if not isinstance(mark, dict):
            if failure.exitcode == STOPPED:
                continue
            return None
        message = data.get("message")
        line = message.get("message") if isinstance(message, dict) else message
        if not isinstance(line, str):
            return None
        (said.add(line) if mark.get("said") else unsaid.append(line))
    if len(said) + len(unsaid) == 0:
        return None  # only stopped processes: not a refusal
    return [line for line in dict.fromkeys(unsaid) if line not in said]


def excepthook(previous, kind, value, tb) -> None:
    """``sys.excepthook`` of a launcher: a launch that ended in refusals prints their unsaid lines, and no
    traceback; anything else goes to ``previous``."""
    try:
        lines = unsaid_refusals(getattr(value, "failures", None) or {})
    except Exception:  # noqa: BLE001 (a report torch changed: its own printing is the safe answer)
        lines = None
    if lines is None:
        previous(kind, value, tb)
        return
    for line in lines:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()
