"""Durable writes: what is renamed into place is on the disk first, so a power cut cannot empty it.

Why: a file's data reaches the disk when the kernel gets round to it, seconds after ``write``
returns, while a rename of its directory is committed on its own schedule. After a power cut a
checkpoint renamed into place could hold ``optimizer.pt``, ``scheduler.pt``, RNG states and
tokenizer files of zero length (only ``model.safetensors`` and the manifest were synced), and with
the previous checkpoint already rotated away, no checkpoint was usable. Everything neutrain renames
into place (checkpoints, exports, the recipe copy, data caches) is synced with :func:`fsync_tree`
(or :func:`write_durably`) before the rename, and the directory it lands in with :func:`fsync_dir`
after it; only then is anything it replaces deleted.

Example:
    >>> import os, tempfile
    >>> root = tempfile.mkdtemp()
    >>> write_durably(os.path.join(root, "recipe.yaml"), "train: {}\\n")
    >>> fsync_tree(root)
    >>> open(os.path.join(root, "recipe.yaml")).read()
    'train: {}\\n'
"""

from __future__ import annotations

import os

from neutrain.compat.file_modes import fsync_dir

__all__ = ["fsync_dir", "fsync_file", "fsync_tree", "write_durably"]


def fsync_file(path: str | os.PathLike) -> None:
    """Flush one file's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """Flush every file under ``root``, then every directory (deepest first), to disk.

    Call it on a temporary directory before renaming it into place. Symlinks are not followed (what a
    link points to is not part of the tree).
    """
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                fsync_file(path)
        fsync_dir(dirpath)


def write_durably(path: str | os.PathLike, text: str, tmp: str | os.PathLike | None = None) -> None:
    """Write ``text`` to ``path`` through the temporary name ``tmp`` (default ``<path>.tmp<pid>``), synced
    before it is renamed into place."""
    tmp = tmp or f"{os.fspath(path)}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        # A full disk (or any failure) leaves no partial file behind: what it would have replaced stays.
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))
