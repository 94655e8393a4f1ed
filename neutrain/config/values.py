"""Checking one recipe value against its key's declaration: type, choices, range, text, nested values, path kind.

Why a module of its own: every key of the schema goes through :func:`check_value`, so what a value must be
is decided here once, for each key there is and each key added later (:mod:`neutrain.config.validate`
walks the sections, the datasets and the checks across keys). A value its key's declaration does not allow
is one :class:`~neutrain.errors.RecipeError` line starting with the key.

Example:
    >>> from neutrain.config.schema import SCHEMA
    >>> check_value("train.learning_rate", SCHEMA["train"]["learning_rate"], "1e-5", None)
    1e-05
    >>> check_value("train.fsdp_config", SCHEMA["train"]["fsdp_config"], {"limit": float("nan")}, None)
    Traceback (most recent call last):
    neutrain.errors.RecipeError: train.fsdp_config.limit: nan is not a finite number
"""

from __future__ import annotations

import difflib
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterable

from neutrain.config.schema import Key
from neutrain.errors import RecipeError
from neutrain.files import check_kind, path_too_long


def suggest(name: str, options: Iterable[str]) -> str:
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f" Did you mean '{match[0]}'?" if match else ""


def _type_name(t: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a mapping"}
    if isinstance(t, tuple):
        return " or ".join(names.get(x, x.__name__) for x in t)
    return names.get(t, t.__name__)


def check_value(where: str, key: Key, value: Any, base_dir: Path | None) -> Any:
    """``value`` as the run will use it (a float from a numeric string, a path resolved), or one line naming ``where``."""
    if value is None:
        if key.nullable or key.default is None:
            return None
        raise RecipeError(f"{where}: expected {_type_name(key.type)}, got null")
    types = key.type if isinstance(key.type, tuple) else (key.type,)
    ok = False
    for t in types:
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            value, ok = float(value), True
            break
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            ok = True
            break
        if t not in (int, float) and isinstance(value, t):
            ok = True
            break
    if not ok and float in types and isinstance(value, str):
        # YAML 1.1 reads "1e-5" (no dot) as a string; accept numeric strings for floats.
        try:
            value, ok = float(value), True
        except ValueError:
            pass
    if not ok:
        raise RecipeError(f"{where}: expected {_type_name(key.type)}, got {type(value).__name__} {value!r}")
    if key.choices is not None and value not in key.choices:
        raise RecipeError(f"{where}: {value!r} is not one of {', '.join(map(str, key.choices))}.{suggest(str(value), map(str, key.choices))}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        _check_range(where, key, value)
    if isinstance(value, (list, dict)):
        _check_nested(where, value, key.items)
    if key.pattern is not None and isinstance(value, str) and not re.fullmatch(key.pattern, value, flags=re.IGNORECASE):
        raise RecipeError(f"{where}: {value!r} does not have the expected form ({key.help})")
    if isinstance(value, str):
        _check_text(where, value, as_file_name=bool(key.path) or where.endswith(_PATH_VALUED))
    if key.path and isinstance(value, str):
        value = resolve_path(where, value, base_dir, key.path, "file" if key.path == "file" else "path")
    return value


# Keys whose string is a path (or a hub id standing for one): held to what a file name can be.
_PATH_VALUED = ("output_dir", ".path", "model.base_model", "model.gguf_file", "model.tokenizer", "model.config",
                "train.fsdp_config", "train.deepspeed", "train.resume_from_checkpoint", "distill.target")


def _check_text(where: str, value: str, as_file_name: bool) -> None:
    """No NUL byte (no file name or C string holds one); a path has no control character, no surrounding
    whitespace, encodes in the file-system encoding, and fits its file system's ``NAME_MAX`` and ``PATH_MAX``
    (past them the first ``stat`` raised, naming neither the key nor the fix).

    Why: a NUL and an unencodable name used to end in a traceback (``ValueError: embedded null byte``,
    ``UnicodeEncodeError`` under ``LC_ALL=C`` with Python's UTF-8 mode off) at the first file operation; a
    newline or a trailing space in a path is almost always a quoting accident on the command line, and the
    run would write into a directory no one meant.
    """
    if "\0" in value:
        raise RecipeError(f"{where}: {value!r} contains a NUL byte, which no file name or setting can hold")
    if as_file_name:
        bad = next((c for c in value if ord(c) < 0x20 or ord(c) == 0x7F), None)
        if bad is not None:
            raise RecipeError(f"{where}: {value!r} contains the control character {bad!r}; a path is taken as "
                              "written (check the quoting on the command line)")
        if not value.strip() or value != value.strip():
            raise RecipeError(f"{where}: {value!r} is empty or starts or ends with whitespace; a path is taken as "
                              "written (check the quoting on the command line)")
        try:
            os.fsencode(value)
        except UnicodeEncodeError as exc:
            raise RecipeError(f"{where}: {value!r} has {value[exc.start]!r}, which the file-system encoding "
                              f"({sys.getfilesystemencoding()}, from the locale) cannot write; use a UTF-8 locale "
                              "(e.g. LC_ALL=C.UTF-8) or an ASCII path") from None
        if problem := path_too_long(value):
            raise RecipeError(f"{where}: {shown(value)} is too long for its file system: {problem}")


def _check_nested(where: str, value: list | dict, items: Any = None) -> None:
    """What every value inside a list or mapping must be, whatever its key: a list's elements of type ``items``
    (when the key names one), string mapping keys, finite numbers and no NUL character at any depth.

    Why here and not per key: a key added to the schema gets these checks by construction; a NaN inside
    ``train.fsdp_config`` or a number in ``data.roles_to_train`` reached the libraries the run drives.
    """
    if items is not None and isinstance(value, list):
        for i, element in enumerate(value):
            if not isinstance(element, items) or isinstance(element, bool) is not (items is bool):
                raise RecipeError(f"{where}[{i}]: expected {_type_name(items)}, got {type(element).__name__} "
                                  f"{shown(element)}")
    stack: list[tuple[str, Any]] = [(where, value)]
    while stack:
        at, item = stack.pop()
        if isinstance(item, dict):
            for k, v in item.items():
                if not isinstance(k, str):
                    raise RecipeError(f"{at}: the key {k!r} is not a string (write it in quotes)")
                stack.append((f"{at}.{k}", v))
        elif isinstance(item, list):
            stack.extend((f"{at}[{i}]", v) for i, v in enumerate(item))
        elif isinstance(item, float) and not math.isfinite(item):
            raise RecipeError(f"{at}: {item} is not a finite number")
        elif isinstance(item, str) and "\0" in item:
            raise RecipeError(f"{at}: {shown(item)} contains a NUL byte, which no setting can hold")


COUNT_CEILING = 2**31 - 1
"""The largest number a key with no maximum of its own takes: a count past int32 is a typo, not a setting, and the libraries it reaches index with int32 or spend a unit of work per count (``data.num_proc`` of
1e20 forked processes until the machine ran out)."""


def _check_range(where: str, key: Key, value: float) -> None:
    # NaN compares False with every bound, so without this check it passed them all into the run.
    if not math.isfinite(value):
        raise RecipeError(f"{where}: {value} is not a finite number")
    if key.min is not None and value < key.min:
        raise RecipeError(f"{where}: {value} is below the minimum {key.min}")
    ceiling = key.max if key.max is not None else COUNT_CEILING
    if value > ceiling:
        raise RecipeError(f"{where}: {value} is above the maximum {ceiling:,}")
    if key.gt is not None and not value > key.gt:
        raise RecipeError(f"{where}: {value} must be greater than {key.gt}")
    if key.lt is not None and not value < key.lt:
        raise RecipeError(f"{where}: {value} must be less than {key.lt}")


def resolve_path(where: str, value: str, base_dir: Path | None, kind: str = "any", noun: str = "path") -> str:
    """A recipe path as it will be used: as given (relative to the current directory), else relative to the recipe.

    The current directory wins when the path exists in both; the error for a missing path names both
    places it looked, so a relative path never fails without saying what it was relative to.

    Example:
        >>> resolve_path("train.deepspeed", "/etc/hostname", None, "file")
        '/etc/hostname'
        >>> resolve_path("train.deepspeed", "/dev/zero", None, "file")
        Traceback (most recent call last):
        neutrain.errors.RecipeError: train.deepspeed: path '/dev/zero' is a character device, not a regular file
    """
    p = Path(value).expanduser()
    if not p.is_absolute() and base_dir is not None and not os.path.lexists(p) and os.path.lexists(base_dir / p):
        p = base_dir / p
    if not os.path.lexists(p):
        looked = ""
        if not p.is_absolute():
            looked = f" (relative paths are looked up in the current directory {Path.cwd()}"
            looked += f", then in the recipe's directory {Path(base_dir).resolve()})" if base_dir is not None else ")"
        raise RecipeError(f"{where}: {noun} '{value}' does not exist{looked}")
    # Its kind by stat, nothing opened: a FIFO, a device or a directory is named as what it is.
    check_kind(p, f"{where}: {noun} '{value}'", RecipeError, want=kind)
    return str(p)


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
