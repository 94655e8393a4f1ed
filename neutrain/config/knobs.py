"""Every ``NEUTRAIN_*`` environment variable: declared once with its type and range, read through one reader.

Why: each variable used to be parsed where it was used, each in its own way. ``NEUTRAIN_KEEP_DECODED_MIB=inf``
ended in a raw ``OverflowError``; ``NEUTRAIN_STOP_GRACE_S=1e12`` was accepted at start and raised
``OverflowError: timestamp out of range`` in the middle of the save a SIGTERM asked for; ``NEUTRAIN_SAGE_KERNEL``
raised where attention first ran. Here :data:`KNOBS` declares each variable (type, default, range, help), as
the recipe schema declares each key; :func:`knob` is the only reader, and :func:`check_environment` checks
every variable set at the start of a command, so a bad value is one line naming the variable before anything
runs. A new variable is declared here or it cannot be read (``tests/faults/test_environment_knobs.py`` checks
that the package reads no ``NEUTRAIN_*`` variable in any other way).

Example:
    >>> knob("NEUTRAIN_STOP_GRACE_S", {"NEUTRAIN_STOP_GRACE_S": "30"})
    30.0
    >>> knob("NEUTRAIN_KEEP_DECODED_MIB", {"NEUTRAIN_KEEP_DECODED_MIB": "inf"})
    Traceback (most recent call last):
    neutrain.config.knobs.EnvironmentVariableError: environment variable NEUTRAIN_KEEP_DECODED_MIB='inf': not a finite number; expected a number from 0 to 1,048,576 (MiB of decoded weights kept per device; 0: off)
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from neutrain.config.numbers import parse_number
from neutrain.errors import UserInputError
from neutrain.files import kind_word

PREFIX = "NEUTRAIN_"
_TRUE, _FALSE = ("1", "true", "yes", "on", "y", "t"), ("0", "false", "no", "off", "n", "f")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class EnvironmentVariableError(UserInputError):
    """A ``NEUTRAIN_*`` variable holds a value its declaration refuses (the message names it and the rule)."""


@dataclass(frozen=True)
class Knob:
    """One environment variable.

    Args:
        type: ``bool``, ``int``, ``float``, ``str`` (one of ``choices``), ``"level"`` (a log level) or
            ``"path"`` (an existing file, or directory with ``directory``).
        default: The value when the variable is unset or empty.
        help: What it sets, shown in the error.
        choices / min / max / gt: What a value may be (``gt``: exclusive lower bound).
    """

    type: Any
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    min: float | None = None
    max: float | None = None
    gt: float | None = None
    directory: bool = False


SAGE_POLICIES = ("table", "always", "never")
SAGE_KERNELS = ("triton", "gluon")
SAGE_BACKWARDS = ("triton", "cudnn", "flash", "cpu")

KNOBS: dict[str, Knob] = {
    "NEUTRAIN_DEBUG": Knob(bool, False, "show the traceback instead of the one-line error"),
    "NEUTRAIN_LOG_LEVEL": Knob("level", logging.INFO, "the level of neutrain's log lines"),
    "NEUTRAIN_RECIPES": Knob("path", None, "a directory of recipes looked up by name", directory=True),
    "NEUTRAIN_STOP_GRACE_S": Knob(float, 120.0, "seconds from SIGTERM to the step boundary before the run stops "
                                  "without saving", gt=0.0, max=7 * 86400.0),
    "NEUTRAIN_KEEP_DECODED_MIB": Knob(float, None, "MiB of decoded weights kept per device; 0: off", min=0.0,
                                      max=float(1 << 20)),
    "NEUTRAIN_FUSED_UPDATE": Knob(bool, True, "LOMO's one-kernel update on a GPU (0: the reference ops)"),
    "NEUTRAIN_OFFLOAD_SYNC_DEBUG": Knob(bool, False, "synchronise and check each weight-offload call"),
    "NEUTRAIN_SAGE_DISPATCH": Knob(str, "table", "when SageAttention runs", choices=SAGE_POLICIES),
    "NEUTRAIN_SAGE_KERNEL": Knob(str, None, "SageAttention's forward kernel, over the table's", choices=SAGE_KERNELS),
    "NEUTRAIN_SAGE_BACKWARD": Knob(str, "triton", "SageAttention's backward route", choices=SAGE_BACKWARDS),
    "NEUTRAIN_SAGE_DISPATCH_TABLE": Knob("path", None, "another SageAttention dispatch table (JSON)"),
    "NEUTRAIN_SAGE_FUSED_QUANT": Knob(bool, True, "SageAttention's fused quantization kernel (0: torch ops)"),
    "NEUTRAIN_SAGE_QUANT_SEPARATE_PASSES": Knob(bool, False, "SageAttention's fused quantization as its older "
                                                "separate passes (K mean and V amax in torch, one token group per "
                                                "Q/K program), for timing against the one stats pass"),
    "NEUTRAIN_SAGE_V_RESIDUAL": Knob(bool, False, "SageAttention's second FP8 product per tile for V's rounding "
                                     "residual (1; 0, the default: plain SageAttention2, one product per tile)"),
    "NEUTRAIN_CPU_CODEC": Knob(str, "auto", "the CPU codec: auto (compiled when numba is installed) or torch",
                               choices=("auto", "numba", "torch")),
    "NEUTRAIN_SMOLLM2_GGUF": Knob("path", None, "the SmolLM2 GGUF file the real-model evaluation loads"),
    "NEUTRAIN_HOST_MEMORY_GIB": Knob(float, None, "GiB of host memory the memory plan and the host check count on, in "
                                     "place of what the system reports available (a virtual machine whose memory "
                                     "grows as it is used reports too little at first)", gt=0.0, max=float(1 << 20)),
    "NEUTRAIN_LAYER_GROUPS": Knob(str, "auto", "decoder layers decoded and re-encoded as groups: auto (on a GPU, where "
                                  "a layer fits the vocabulary matrix's slot), 1 (always) or 0 (never)",
                                  choices=("auto", "1", "0")),
}


def _rule(k: Knob) -> str:
    if k.type is bool:
        return "a boolean (1/0, true/false, yes/no, on/off)"
    if k.type == "level":
        return f"a log level ({', '.join(LOG_LEVELS)}, any case) or a number from 0 to 50"
    if k.type == "path":
        return "the path of an existing " + ("directory" if k.directory else "file")
    if k.choices:
        return "one of " + ", ".join(k.choices)
    noun = "an integer" if k.type is int else "a number"
    low = f"greater than {k.gt:g}" if k.gt is not None else f"from {k.min:g}" if k.min is not None else ""
    high = f" to {k.max:,.0f}" if k.max is not None and low.startswith("from") else \
        f" and at most {k.max:,.0f}" if k.max is not None else ""
    return f"{noun} {low}{high}".strip()


def _parse(name: str, k: Knob, raw: str) -> Any:
    """The value of ``raw`` for knob ``k``, or the reason it is refused (raised as :class:`_Refused`)."""
    text = raw.strip()
    if k.type != "path" and not text.isascii():  # 'ınfo'.upper() is 'INFO': a case mapping is no spelling
        raise _Refused("not ASCII text")
    if k.type is bool:
        if text.lower() in _TRUE or text.lower() in _FALSE:
            return text.lower() in _TRUE
        raise _Refused("not a boolean")
    if k.type == "level":
        if text.upper() in LOG_LEVELS:
            return getattr(logging, text.upper())
        level = parse_number(text, integer=True)
        if level is not None and 0 <= level <= 50:
            return level
        raise _Refused("not a log level")
    if k.type == "path":
        try:
            mode = os.stat(text).st_mode
        except (OSError, ValueError):  # ValueError: a NUL byte, which no path holds
            raise _Refused("no such file or directory") from None
        if not (stat.S_ISDIR(mode) if k.directory else stat.S_ISREG(mode)):
            raise _Refused(f"it is {kind_word(mode)}")
        return text
    if k.choices:
        if text.lower() in k.choices:
            return text.lower()
        match = difflib.get_close_matches(text.lower(), k.choices, n=1)
        raise _Refused("not a choice" + (f" (did you mean {match[0]}?)" if match else ""))
    value = parse_number(text, integer=k.type is int)
    if value is None:
        raise _Refused(f"not {'an integer' if k.type is int else 'a number'} (written with ASCII digits)")
    if not math.isfinite(value):
        raise _Refused("not a finite number")
    if (k.min is not None and value < k.min) or (k.gt is not None and not value > k.gt) or \
            (k.max is not None and value > k.max):
        raise _Refused("out of range")
    return value


class _Refused(Exception):
    pass


def knob(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The typed value of the environment variable ``name`` (a key of :data:`KNOBS`): its default when unset
    or empty.

    Raises:
        EnvironmentVariableError: one line naming the variable, its value and what it must be.
        KeyError: ``name`` is not declared in :data:`KNOBS` (a programming error, not a user's).
    """
    k = KNOBS[name]
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or not raw.strip():
        return k.default
    try:
        return _parse(name, k, raw)
    except _Refused as why:
        shown = raw if len(raw) <= 80 else raw[:77] + "..."
        raise EnvironmentVariableError(f"environment variable {name}={shown!r}: {why}; expected {_rule(k)} "
                                       f"({k.help})") from None


def check_environment(environ: Mapping[str, str] | None = None) -> list[str]:
    """Check every ``NEUTRAIN_*`` variable that is set (raises on the first bad one, as :func:`knob` does).

    Returns:
        One warning line per variable with the prefix that neutrain does not know (a typo keeps its
        default silently otherwise), naming the closest declared one.
    """
    environ = os.environ if environ is None else environ
    unknown = []
    for name in sorted(n for n in environ if n.startswith(PREFIX)):
        if name in KNOBS:
            knob(name, environ)
            continue
        match = difflib.get_close_matches(name, list(KNOBS), n=1, cutoff=0.8)
        if match:  # an unrelated NEUTRAIN_ name (a script's own) is not ours to warn about
            unknown.append(f"environment variable {name} is not one neutrain reads; did you mean {match[0]}?")
    return unknown
