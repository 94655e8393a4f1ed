"""A start that is refused before its first step leaves the run directory as it found it.

Why: a run refused for want of disk space (or any other check after the model was built) had already
written its identity, its recipe copy, its tokenizer folder and its data cache into ``train.output_dir``,
often a folder it had created itself: the user was left with a half-started run to delete by hand, and
the next launch there with another recipe was refused as "another run's".

:func:`undone_if_refused` notes, before anything is written, what the directory holds (nothing at all
where it does not exist, and which folders above it are missing), and the size of its identity file.
When the start fails, it removes only what this start added there, and only while this process holds the
run's lock (no other run writes there then): the names the run listed as written since
(:mod:`neutrain.storage.run_dir`) and neutrain's own housekeeping files, then
the identity lines it appended, then the directories it created, where they are empty again. A file
that appeared there from elsewhere meanwhile is left, and so is anything once the first step is under way.

Example:
    >>> with undone_if_refused("outputs/run"):  # doctest: +SKIP
    ...     build_and_check()  # a refusal raised here takes back what the start wrote
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path

from neutrain.storage.run_dir import IDENTITY, is_housekeeping, read_ledger
from neutrain.storage.run_lock import RunDirectoryError, holds, names_in

logger = logging.getLogger("neutrain")


class StartRecord:
    """What ``output_dir`` was before a start: its names, its identity file's size and inode, missing folders."""

    def __init__(self, output_dir: str | os.PathLike):
        self.root = Path(os.path.abspath(output_dir))
        self.names = set(names_in(self.root))
        self.wrote = set(_listed(self.root))
        self.missing = []  # the folders a start would create, deepest first
        directory = self.root
        while not os.path.lexists(directory) and directory != directory.parent:
            self.missing.append(directory)
            directory = directory.parent
        try:
            st = os.stat(self.root / IDENTITY)
            self.identity = (st.st_ino, st.st_size)
        except OSError:
            self.identity = None

    def undo(self) -> list[str]:
        """Take back what was added since; returns the paths removed (logged once, together)."""
        if not self.root.is_dir() or self.root.is_symlink():
            return []
        if not holds(self.root):  # refused before this process took the directory: nothing of it is this start's
            self._remove_created_folders()
            return []
        listed = set(_listed(self.root)) - self.wrote  # claimed by this start, each before it was written
        removed = []
        for name in sorted(set(names_in(self.root)) - self.names):
            if name in listed or (is_housekeeping(name) and name != IDENTITY):
                _remove(self.root / name)
                removed.append(name)
        self._restore_identity(removed)
        self._remove_created_folders()
        if removed:
            logger.info("the refused start took back what it wrote in %s: %s", self.root, ", ".join(removed))
        return removed

    def _remove_created_folders(self) -> None:
        for directory in self.missing:  # deepest first: each only when empty again
            try:
                os.rmdir(directory)
            except OSError:
                break

    def _restore_identity(self, removed: list[str]) -> None:
        path = self.root / IDENTITY
        try:
            st = os.stat(path)
        except OSError:
            return
        if self.identity is None:  # written by this start: the directory was empty (or absent) before it
            path.unlink()
            removed.append(IDENTITY)
        elif st.st_ino == self.identity[0] and st.st_size > self.identity[1]:
            os.truncate(path, self.identity[1])  # only appended to: the lines this start added go


def _listed(root: Path) -> list[str]:
    try:
        ledger = read_ledger(root)
    except RunDirectoryError:
        return []
    return ledger.wrote if ledger is not None else []


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        path.unlink()


@contextlib.contextmanager
def undone_if_refused(output_dir: str | os.PathLike, active: bool = True):
    """Run the start inside; on any failure, :meth:`StartRecord.undo` before the error goes on. ``active=False``
    (the launch's other processes: the main one writes the run directory) records and undoes nothing."""
    record = StartRecord(output_dir) if active else None
    try:
        yield
    except BaseException:
        if record is not None:
            record.undo()
        raise
