"""One line for a failure of the environment (full disk, read-only file system, unusable output path).

Why: such a failure used to end a run with a traceback from whichever library
was writing (``OSError`` from a plain write, ``SafetensorError`` from
safetensors, a ``RuntimeError`` from ``torch.save``), although the fix is
always outside neutrain. :func:`describe_environment_error` finds the
operating-system error in any of these and :func:`neutrain.cli.main` prints

    neutrain: error: <what> (<path>): <strerror>

with exit code 1. ``NEUTRAIN_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from neutrain.errors import UserInputError

EXIT_ENVIRONMENT = 1

# safetensors (Rust) reports "I/O error: No space left on device (os error 28)".
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
# torch.save's C++ writer reports a failed write without errno (e.g. "unexpected pos 704 vs 598").
_TORCH_WRITE_FAILURE = ("PytorchStreamWriter failed", "inline_container.cc", "file write failed", "iostream error")

_WHAT = {
    errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded", errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied", errno.EPERM: "permission denied", errno.ENOTDIR: "not a directory",
    errno.EEXIST: "path exists", errno.EISDIR: "is a directory", errno.EIO: "I/O error",
}


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _free_bytes(path: str | None) -> int | None:
    if not path:
        return None
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def _errno_of(exc: BaseException, fallback_path: str | None) -> tuple[int | None, str | None, BaseException] | None:
    """(errno, filename, the exception that carried it) for the first environment failure in the chain."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno, e.filename, e
        m = _RUST_OS_ERROR.search(str(e))
        if m and type(e).__name__ == "SafetensorError":
            return int(m.group(1)), None, e
        if isinstance(e, RuntimeError) and any(s in str(e) for s in _TORCH_WRITE_FAILURE):
            free = _free_bytes(fallback_path)
            return (errno.ENOSPC if free is not None and free < 1 << 20 else None), None, e
    return None


def describe_environment_error(exc: BaseException, fallback_path: str | None = None) -> str | None:
    """The one-line message for an environment failure anywhere in ``exc``'s chain, else None.

    Args:
        exc: The exception that reached the top level.
        fallback_path: Where the command was writing (the run's ``output_dir``), named when the
            error itself carries no file name (a plain ``write`` or ``torch.save``).

    Example:
        >>> describe_environment_error(OSError(errno.ENOSPC, "No space left on device", "/out/metrics.jsonl"))
        'disk full (/out/metrics.jsonl): No space left on device'
    """
    found = _errno_of(exc, fallback_path)
    if found is None:
        return None
    code, filename, carrier = found
    notes = getattr(carrier, "__notes__", None) or getattr(exc, "__notes__", None)
    what = notes[0] if notes else _WHAT.get(code, "file system error") if code is not None else "writing a file failed"
    path = filename or fallback_path or "unknown path"
    if getattr(carrier, "filename2", None):
        path = f"{path} -> {carrier.filename2}"
    if code is not None:
        reason = os.strerror(code)
    else:  # torch's writer gives no errno and the disk is not full: pass its words on
        reason = " ".join(str(carrier).split())
    return f"{what} ({path}): {reason}"


# Variables a launcher (torchrun, accelerate launch, SLURM scripts) sets and Accelerate parses at start-up.
_COUNTS = {"WORLD_SIZE": 1, "LOCAL_WORLD_SIZE": 1, "RANK": 0, "LOCAL_RANK": 0, "NODE_RANK": 0, "MASTER_PORT": 0}
_SWITCHES = ("ACCELERATE_USE_CPU", "ACCELERATE_DEBUG_MODE", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP")
_BOOLEANS = ("y", "yes", "t", "true", "on", "1", "n", "no", "f", "false", "off", "0")  # accelerate's str_to_bool
_PRECISIONS = ("no", "fp8", "fp16", "bf16")


def check_launch_environment(environ) -> None:
    """Refuse launch variables that Accelerate would fail to parse, in one line naming the variable.

    Why: ``WORLD_SIZE=abc`` or ``ACCELERATE_USE_CPU=maybe`` (a typo in a job script) ended in a
    ``ValueError`` traceback from inside Accelerate's start-up.

    Example:
        >>> check_launch_environment({"WORLD_SIZE": "abc"})
        Traceback (most recent call last):
        neutrain.errors.UserInputError: environment variable WORLD_SIZE='abc' is not an integer >= 1 (it is set by launchers: torchrun, accelerate launch); unset it or fix the job script
    """
    for name, low in _COUNTS.items():
        value = environ.get(name)
        if value is not None and not (value.strip().isdigit() and int(value) >= low):
            raise UserInputError(f"environment variable {name}={value!r} is not an integer >= {low} (it is set by "
                                 "launchers: torchrun, accelerate launch); unset it or fix the job script")
    for name in _SWITCHES:
        value = environ.get(name)
        if value is not None and value.strip().lower() not in _BOOLEANS:
            raise UserInputError(f"environment variable {name}={value!r} is not a boolean (true/false, 1/0, yes/no)")
    value = environ.get("ACCELERATE_MIXED_PRECISION")
    if value is not None and value.strip().lower() not in _PRECISIONS:
        raise UserInputError(f"environment variable ACCELERATE_MIXED_PRECISION={value!r} is not one of "
                             f"{', '.join(_PRECISIONS)}")
