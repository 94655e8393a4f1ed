"""Nothing read or written outside the run or checkpoint directory: symlinks and paths that leave it are refused.

Why: ``summary.json``, ``metrics.jsonl`` and ``training_curves.png``
were written through symlinks pointing outside the run directory; manifest entries such as
``../../etc/passwd`` or absolute paths were read, which made export, resume and eval a
size and hash oracle for any readable file; and a ``model.safetensors`` symlinked outside
its checkpoint was loaded silently.

A symlink whose target stays inside the directory is allowed (a user may link
``metrics.jsonl`` into a subfolder); one that leaves it, a ``..`` or an absolute path is
refused in one line naming the path and where it leads.

Example:
    >>> import tempfile
    >>> root = tempfile.mkdtemp()
    >>> inside(root, "metrics.jsonl").name
    'metrics.jsonl'
    >>> try:
    ...     inside(root, "../etc/passwd")
    ... except ConfinementError:
    ...     print("refused")
    refused
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from neutrain.errors import CheckpointError

# What a run writes at the top of its output_dir (neutrain.cli.train, neutrain.trainer.callbacks, ...).
RUN_FILES = ("metrics.jsonl", "summary.json", "training_curves.png", "recipe.yaml", "training_args.json",
             "tokenizer", "eval", ".cache")


class ConfinementError(CheckpointError):
    """A path, or a symlink's target, leaves the run or checkpoint directory it belongs to."""


def _within(path: Path, root: Path) -> bool:
    real, top = os.path.realpath(path), os.path.realpath(root)
    return real == top or real.startswith(top.rstrip(os.sep) + os.sep)


def inside(root: str | os.PathLike, rel: str) -> Path:
    """``root / rel``, refused unless ``rel`` is relative, has no ``..`` and (symlinks followed) stays in ``root``."""
    root = Path(root)
    parts = PurePosixPath(rel.replace("\\", "/")).parts
    if not rel or os.path.isabs(rel) or PurePosixPath(rel).is_absolute() or ".." in parts:
        raise ConfinementError(f"'{rel}' leaves {root} (a '..' or an absolute path): refused")
    path = root / rel
    if not _within(path, root):
        raise ConfinementError(f"'{path}' leads to {os.path.realpath(path)}, outside {root} (a symlink): refused")
    return path


def check_output(path: str | os.PathLike, root: str | os.PathLike) -> Path:
    """``path`` (an output of the run in ``root``), refused when a symlink makes it lead outside ``root``.

    Example:
        >>> import tempfile
        >>> root = tempfile.mkdtemp()
        >>> check_output(f"{root}/summary.json", root).name
        'summary.json'
    """
    path = Path(path)
    if (path.is_symlink() or path.exists()) and not _within(path, root):
        raise ConfinementError(f"'{path}' is a symlink to {os.path.realpath(path)}, outside the run directory "
                               f"{root}: neutrain writes only inside it; remove the link")
    return path


def check_run_outputs(root: str | os.PathLike, names: tuple[str, ...] = RUN_FILES) -> None:
    """Refuse a run whose output directory holds a symlink, among its own file names, that leads outside it."""
    for name in names:
        check_output(Path(root) / name, root)


def check_tree(directory: str | os.PathLike) -> None:
    """Refuse a checkpoint (or export) holding a symlink, at any depth, that leads outside it; reads no file."""
    directory = Path(directory)
    for dirpath, dirnames, filenames in os.walk(directory):  # os.walk does not descend into linked directories
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            if path.is_symlink() and not _within(path, directory):
                raise ConfinementError(f"checkpoint file '{path}' is a symlink to {os.path.realpath(path)}, outside "
                                       f"the checkpoint {directory}: refused")
