"""What any recipe value must be beyond its type and range: a registered name, text a setting can hold, a
path that exists, no NaN or NUL at any depth; and the words the one-line errors use.

Why a module of its own: pydantic checks each key's type and range (:mod:`neutrain.config.fields`); every key
also goes through :func:`held_to_key`, so what holds for any value is decided here once, for each key there is
and each key added later. A value its key refuses is one :class:`~neutrain.errors.RecipeError` line starting
with the key.

Example:
    >>> from neutrain.config.schema import SCHEMA
    >>> held_to_key("train.fsdp_config", SCHEMA["train"]["fsdp_config"], {"limit": float("nan")}, None)
    Traceback (most recent call last):
    neutrain.errors.RecipeError: train.fsdp_config.limit: nan is not a finite number
"""

from __future__ import annotations

import difflib
import math
import os
import sys
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Iterable

from pydantic import BaseModel

from neutrain.config.names import Names
from neutrain.errors import RecipeError
from neutrain.files import check_kind, folder_kind_trouble, link_trouble, not_text, path_too_long


@dataclass(frozen=True)
class Key:
    """What a key accepts, read off its field: the view the help text, the overrides and the messages use.

    Args:
        type: Python type(s) accepted (``float`` also accepts ints).
        default: Value when the recipe omits the key (``REQUIRED`` if mandatory).
        help: One line shown by ``neutrain train --help`` (the field's docstring).
        choices: Allowed values: a closed set, or the :class:`~neutrain.config.names.Names` a registry fills.
        min / max / gt / lt: Inclusive and exclusive numeric bounds.
        pattern: Regular expression a string value must match in full.
        path: ``"file"``, ``"dir"`` or ``"any"`` if the value is a path that must exist.
        nullable: Whether ``null`` is accepted.
        items: The type every element of a list value must have.
    """

    type: Any
    default: Any
    help: str
    choices: Any = None
    min: float | None = None
    max: float | None = None
    gt: float | None = None
    lt: float | None = None
    pattern: str | None = None
    path: str | None = None
    nullable: bool = False
    items: Any = None


def suggest(name: str, options: Iterable[str]) -> str:
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f" Did you mean '{match[0]}'?" if match else ""


def type_name(t: Any) -> str:
    """How a message names the type(s) a key takes ("an integer or a string")."""
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a mapping"}
    if isinstance(t, tuple):
        return " or ".join(names.get(x, x.__name__) for x in t)
    return names.get(t, t.__name__)


def held_to_key(where: str, key: Key, value: Any, base_dir: Path | None) -> Any:
    """``value``, of its key's type already, as the run will use it (a path resolved), or one line naming ``where``."""
    if value is None:
        return None
    if isinstance(key.choices, Names) and value not in key.choices:
        raise RecipeError(f"{where}: {value!r} is not one of {', '.join(key.choices)}.{suggest(str(value), key.choices)}")
    if isinstance(value, (list, dict)):
        check_nested(where, value)
    if isinstance(value, str):
        check_text(where, value, as_file_name=bool(key.path) or where.endswith(_PATH_VALUED))
    if where in OUTPUT_FOLDERS + LATER_FOLDERS and isinstance(value, str) and (
            trouble := link_trouble(Path(value).expanduser())):
        raise RecipeError(f"{where}: '{value}' {trouble}")
    if where in OUTPUT_FOLDERS and isinstance(value, str) and (trouble := folder_kind_trouble(Path(value).expanduser())):
        raise RecipeError(f"{where}: '{value}' {trouble}; name a directory")  # a FIFO or a device, at load
    if where in LATER_FOLDERS and isinstance(value, str) and os.path.lexists(Path(value).expanduser()):
        # Read only by a later command (distill after training), yet refused now: a device or a file there
        # failed after the whole training, or never.
        check_kind(Path(value).expanduser(), f"{where}: '{value}'", RecipeError, want="dir")
    if key.path and isinstance(value, str):
        value = resolve_path(where, value, base_dir, key.path, "file" if key.path == "file" else "path")
    return value


# Keys whose string is a path (or a hub id standing for one): held to what a file name can be.
_PATH_VALUED = ("output_dir", ".path", "model.base_model", "model.gguf_file", "model.tokenizer", "model.config",
                "train.fsdp_config", "train.deepspeed", "train.resume_from_checkpoint", "distill.target")


# Keys naming a folder a command creates and writes.
OUTPUT_FOLDERS = ("train.output_dir", "export.output_dir")
# Keys naming a model folder that may not exist yet at load (the run's own export): checked if it does.
LATER_FOLDERS = ("distill.target",)


def check_text(where: str, value: str, as_file_name: bool) -> None:
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
    if problem := not_text(value):  # the recipe beside the checkpoints, the tokenizer's files: all UTF-8
        raise RecipeError(f"{where}: {shown(value)} cannot be written as text: {problem}; use a UTF-8 name or value")
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


def check_nested(where: str, value: list | dict) -> None:
    """What every value inside a list or mapping must be, whatever its key: string mapping keys, JSON's types only
    (text, numbers, booleans, null, lists, mappings), finite numbers and no NUL character at any depth.

    Why here and not per key: a key added to the schema gets these checks by construction; a NaN inside
    ``train.fsdp_config`` reached the libraries the run drives.
    """
    stack: list[tuple[str, Any]] = [(where, value)]
    while stack:
        at, item = stack.pop()
        if isinstance(item, dict):
            for k, v in item.items():
                if not isinstance(k, str):
                    raise RecipeError(f"{at}: the key {k!r} is not a string (write it in quotes)")
                stack.append((f"{at}.{k}", v))
        elif isinstance(item, (list, tuple)):
            stack.extend((f"{at}[{i}]", v) for i, v in enumerate(item))
        elif not isinstance(item, (str, int, float, type(None), BaseModel)):  # a model: its own fields were checked
            # A date, bytes or a set (from Python, or YAML's own tags) reached the run's JSON writers as a TypeError.
            raise RecipeError(f"{at}: {shown(item)} is of type {type(item).__name__}, not a recipe value (text, a "
                              "number, a boolean, null, a list or a mapping)")
        elif isinstance(item, float) and not math.isfinite(item):
            raise RecipeError(f"{at}: {item} is not a finite number")
        elif isinstance(item, str) and "\0" in item:
            raise RecipeError(f"{at}: {shown(item)} contains a NUL byte, which no setting can hold")


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
