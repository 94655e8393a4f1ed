"""Where an export may be written: never over anything but a previous neutrain export, and atomically.

Why: an export used to rename its output directory aside and delete it once the
new export was in place, whatever it held. ``--output`` pointing at the run
directory or a checkpoint deleted every checkpoint, the metrics and the recipe
(exit 0); pointing at a file, it moved the file aside and crashed.

The rules, for ``neutrain export --output``, the recipe's ``export.output_dir``
and the Python API alike:

* the output does not exist, or is an empty directory: the export is written;
* it is a previous neutrain export (a directory whose ``neutrain_export.json``,
  written into every export, is valid and which has no subdirectory): replaced
  only when ``overwrite`` is true, refused otherwise;
* anything else (a file, a symbolic link, a run or checkpoint directory, any
  other non-empty directory): refused, ``overwrite`` or not, with nothing written.

The export is written into a temporary sibling ``.tmp-<name>-<pid>`` and renamed
into place. If writing fails, the temporary is removed and a previous export
stays as it was; a previous export is only deleted once the new one is in place.

Example:
    >>> from neutrain.export.target import staged_export
    >>> with staged_export("outputs/run/export", overwrite=True) as tmp:  # doctest: +SKIP
    ...     (tmp / "config.json").write_text("{}")
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Iterator

from neutrain.errors import UserInputError
from neutrain.files import read_json_object
from neutrain.storage.durable import fsync_dir, fsync_tree
from neutrain.storage.leftovers import restore_set_aside_export
from neutrain.storage.manifest import EXPORT_INFO  # written into every export; also what marks one as neutrain's
from neutrain.storage.manifest import content_hash, foreign_files


class ExportTargetError(UserInputError):
    """The export's output exists and may not be replaced (the message names it and says why)."""


def is_export(path: str | os.PathLike) -> bool:
    """True for a directory written by a neutrain export: a valid ``neutrain_export.json``, no subdirectory.

    A directory with subdirectories is never taken for an export, even with the file in it: an export
    has none, so anything below it was put there by someone else (a run, an evaluation) and would be lost.

    Example:
        >>> is_export("outputs/run/export"), is_export("outputs/run")  # doctest: +SKIP
        (True, False)
    """
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        info = read_json_object(path / EXPORT_INFO, f"export info '{path / EXPORT_INFO}'", UserInputError)
    except UserInputError:
        return False
    if not isinstance(info.get("format"), str):
        return False
    return not any(entry.is_dir() for entry in path.iterdir())


def source_changed(path: str | os.PathLike) -> str | None:
    """Why the export in ``path`` is no longer the model at the checkpoint path it records, else None.

    Why: an export made by ``neutrain export RUN --output RUN/export-hf`` still named ``RUN/checkpoint-4`` after
    the run was overwritten, and that path then held other weights; nothing said so. The export records the
    checkpoint's content hash (the sha256 of its manifest), compared here with what the path holds now.

    Example:
        >>> import tempfile
        >>> source_changed(tempfile.mkdtemp()) is None  # no record: nothing to compare
        True
    """
    info_path = Path(path) / EXPORT_INFO
    try:
        info = read_json_object(info_path, f"export info '{info_path}'", UserInputError)
        checkpoint, recorded = info["checkpoint"], info["checkpoint_sha256"]
    except (UserInputError, KeyError):
        return None
    if not (isinstance(checkpoint, str) and isinstance(recorded, str)) or not Path(checkpoint).is_dir():
        return None  # rotated away or moved: the export keeps its own weights, and no other model claims the path
    now = content_hash(checkpoint)
    if now == recorded:
        return None
    return (f"export '{path}' was made from {checkpoint} (content sha256 {recorded[:12]}), which now holds other "
            f"weights (sha256 {now[:12] if now else 'unknown: no manifest'}): the export is not the model at that path "
            f"any more, and the path is not the export's source")


def _describe(path: Path) -> str:
    if path.is_symlink():
        return "a symbolic link"
    if not path.is_dir():
        return "a file"
    entries = sorted(entry.name for entry in path.iterdir())
    shown = ", ".join(entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
    return f"a directory holding {shown}"


def check_export_target(path: str | os.PathLike, overwrite: bool, key: str = "output_dir",
                        overwrite_hint: str = "overwrite=True", keep: tuple[tuple[str, str], ...] = ()) -> None:
    """Raise :class:`ExportTargetError` unless an export may be written to ``path`` (see the module rules).

    Args:
        path: The export's output directory.
        overwrite: Whether a previous neutrain export there may be replaced.
        key: What the user called the path (``--output``, ``export.output_dir``), for the message.
        overwrite_hint: How the user allows replacing a previous export, for the message.
        keep: ``(key, directory)`` pairs the export may neither be nor contain, even before they exist
            (a run's ``train.output_dir``, checked before training writes anything there).

    Example:
        >>> check_export_target("outputs/run", overwrite=True, key="--output")  # doctest: +SKIP
        Traceback (most recent call last):
        ExportTargetError: --output 'outputs/run' exists and is not a neutrain export (a directory holding ...
    """
    path = Path(path)
    if not (path.exists() or path.is_symlink()):
        restore_set_aside_export(path)  # a previous export an interrupted replacement set aside is put back first
    for keep_key, directory in keep:
        kept = Path(os.path.abspath(directory))
        if kept == Path(os.path.abspath(path)) or Path(os.path.abspath(path)) in kept.parents:
            raise ExportTargetError(f"{key} '{path}' is or contains {keep_key} '{directory}', which the export "
                                    "would replace: choose another directory")
    if not (path.exists() or path.is_symlink()):
        ancestor = Path(os.path.abspath(path)).parent
        while not ancestor.exists():
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            # An unusable output path is an environment failure (exit 1), like a full disk or a read-only mount.
            exc = NotADirectoryError(errno.ENOTDIR, "a file stands where a directory is needed", str(ancestor))
            exc.add_note(f"{key} is not writable")
            raise exc
        return
    if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
        return  # an empty directory: nothing to lose
    if not is_export(path):
        raise ExportTargetError(f"{key} '{path}' exists and is not a neutrain export ({_describe(path)}); "
                                "nothing was written: choose a new directory")
    if not overwrite:
        raise ExportTargetError(f"{key} '{path}' holds a previous neutrain export; {overwrite_hint} replaces it")
    foreign = foreign_files(path)
    if foreign:  # replacing the export would delete it with the folder
        raise ExportTargetError(f"{key} '{path}' holds a previous neutrain export and '{foreign[0]}', which no export "
                                "wrote: nothing was written; move that file out, or choose a new directory")


@contextlib.contextmanager
def staged_export(output_dir: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory to write an export into; move it to ``output_dir`` on success.

    The target is checked before anything is written and again just before the rename. On any
    exception (or interrupt) the temporary directory is removed and ``output_dir`` is left as it was.

    Raises:
        ExportTargetError: if ``output_dir`` may not be replaced (see :func:`check_export_target`).
    """
    out = Path(os.path.abspath(output_dir))  # a sibling name exists even for "." or "a/.."
    check_export_target(out, overwrite)
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # this process's own leftover
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    try:
        yield tmp
        check_export_target(out, overwrite)  # nothing of the user's appeared there meanwhile
        fsync_tree(tmp)  # on the disk before it replaces (and deletes) a previous export
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; a previous export is set aside first and deleted only once ``tmp`` is in place
    (and that rename is on the disk: a power cut must not leave neither)."""
    old = None
    if is_export(out):
        old = out.with_name(f".tmp-old-{out.name}-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    try:  # absent, or an empty directory (rename replaces an empty directory)
        os.replace(tmp, out)
    except BaseException:
        if old is not None:
            os.replace(old, out)
        raise
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
