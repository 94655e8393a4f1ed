"""One run per output directory: a lock held for the life of a run, and a guard for a directory another run used.

Why: two runs started on one ``output_dir`` both trained to exit 0 with interleaved
``metrics.jsonl`` and mixed checkpoints, and a resume started while another run was
saving deleted that run's ``.tmp-checkpoint-N`` as a leftover.

* :class:`RunLock` takes ``<output_dir>/.neutrain.lock``: an exclusive ``flock`` on the
  file for as long as the run lives (the kernel drops it when the process dies, however
  it dies), and the holder's pid, host and start time written in it, so that a refusal
  names the run that holds the directory. A lock file left by a killed run is stale: its
  ``flock`` is gone, and on this host its pid is dead (or taken by a later, unrelated
  process: the process's own start time is recorded too), so the next run takes it over
  (and says so); a record in the previous release's format (no start time) counts only while its
  pid has the lock file open. A lock left by a process on *another* host cannot be checked: refused, naming
  the host and the file to delete once that run is known to be dead. The file is emptied
  on release, never deleted: deleting it would let a waiting process lock the old inode
  while a third creates a new file and locks that.
* :class:`ExportLock` is the same lock on an export directory, in a file beside it
  (``.neutrain-export-<name>.lock``): the export is renamed into place, so a lock inside it
  would go with the directory it replaces. A run holds it from its start to its end, so two
  runs with one ``export.output_dir`` cannot both export there (the first one's summary named
  the second one's model); ``neutrain export`` holds it while it writes.

What a new run may do with a directory another run used is :mod:`neutrain.storage.run_dir`'s.

Only the main process of a launch takes the lock: the other ranks are the same run.
A process that already holds a directory's lock takes it again at once (a run built
twice in one process, as tests and notebooks do); :func:`release` drops it.

Example:
    >>> from neutrain.storage.run_lock import RunLock
    >>> with RunLock("outputs/run"):  # doctest: +SKIP
    ...     train()
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import socket
from pathlib import Path

from neutrain.errors import CheckpointError, UserInputError
from neutrain.storage.leftovers import this_writer, writer_alive

logger = logging.getLogger("neutrain")

LOCK_FILE = ".neutrain.lock"
CHECKPOINT_NAME = re.compile(r"checkpoint-\d+")

_HELD: dict[str, int] = {}  # real path of the lock file -> fd of the lock this process holds on it


class RunDirectoryError(UserInputError):
    """The output directory belongs to another run (live, or whose checkpoints a new run would overwrite)."""


def _holder_text(holder: dict) -> str:
    if not holder:  # being written this instant, or torn
        return "its pid and host are not written yet"
    host, started = holder.get("host"), holder.get("started")  # a record may lack either: no "None" is shown
    return (f"pid {holder.get('pid')}" + (f" on host {host}" if host is not None else "")
            + (f", started {started}" if started is not None else ""))


class RunLock:
    """The lock of one output directory, held from :meth:`acquire` to :meth:`release` (or process exit).

    Raises :class:`RunDirectoryError` (one line, naming the holder and the lock file) when
    another live run holds it.
    """

    key = "train.output_dir"
    """What the user calls the directory, for the messages."""

    def __init__(self, output_dir: str | os.PathLike):
        self.output_dir = Path(output_dir)
        self.path = lock_path(output_dir)
        self._took = False  # whether this object took the lock (a no-op acquire must not release another's)

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        if self._took:
            self.release()

    def acquire(self) -> "RunLock":
        """Take the lock (creating the directory it lies in); a no-op when this process holds it already."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        key = os.path.realpath(self.path)
        if key in _HELD:  # this process already runs here
            return self
        for _ in range(3):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as exc:
                    if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        raise
                    raise RunDirectoryError(self._in_use(self._read(fd))) from None
                if not _same_file(fd, self.path):  # its holder deleted it on release meanwhile: lock the new one
                    os.close(fd)
                    continue
                self._take_over(fd)
            except BaseException:
                os.close(fd)
                raise
            _HELD[key] = fd
            self._took = True
            return self
        raise RunDirectoryError(self._in_use({}))

    def _in_use(self, holder: dict) -> str:
        return (f"{self.key} '{self.output_dir}' is in use by another neutrain run ({_holder_text(holder)}; "
                f"lock {self.path}): wait for it to end, or choose another {self.key}")

    def _read(self, fd: int) -> dict:
        os.lseek(fd, 0, os.SEEK_SET)
        raw = os.read(fd, 4096)
        try:
            holder = json.loads(raw.decode("utf-8")) if raw.strip() else {}
        except (UnicodeDecodeError, ValueError):
            holder = {}  # torn by a kill while it was written: nobody to name
        return holder if isinstance(holder, dict) else {}

    def _take_over(self, fd: int) -> None:
        """With the ``flock`` held: refuse a holder that may still live, else write this process in."""
        holder = self._read(fd)
        if holder:  # the previous holder never released: killed, or on a file system without flock
            pid = holder.get("pid")
            host = holder.get("host")
            # A record naming no host (written by hand, or torn) is not another host's: the flock held here says
            # no process of this host holds the file, so its pid alone decides, as for this host's records.
            if isinstance(host, str) and host != socket.gethostname():
                raise RunDirectoryError(
                    f"{self.key} '{self.output_dir}' is locked by a neutrain run on another host "
                    f"({_holder_text(holder)}); if that run is dead, delete {self.path}")
            if isinstance(pid, int) and pid != os.getpid() and writer_alive(holder, self.path):
                raise RunDirectoryError(self._in_use(holder))
            logger.warning("took over the stale lock %s of a run that is no longer running (%s)",
                           self.path, _holder_text(holder))
        data = json.dumps(this_writer()).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)

    def release(self) -> None:
        """Empty the lock file and drop the ``flock`` (see :func:`release`)."""
        _release(self.path)


class ExportLock(RunLock):
    """The lock of an export directory, in a file beside it (see the module doc), deleted when released: it
    sits in the user's folder, not in a run directory. (A process that locked the file just before it was
    deleted finds it gone and locks the new one: :meth:`RunLock.acquire` checks the inode.)"""

    key = "export.output_dir"

    def __init__(self, export_dir: str | os.PathLike, key: str = "export.output_dir"):
        super().__init__(export_dir)
        self.path = export_lock_path(export_dir)
        self.key = key

    def release(self) -> None:
        release_export(self.output_dir)


def _same_file(fd: int, path: Path) -> bool:
    try:
        held, now = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)


def lock_path(output_dir: str | os.PathLike) -> Path:
    """The lock file of the run directory ``output_dir``."""
    return Path(output_dir) / LOCK_FILE


def unheld(output_dir: str | os.PathLike) -> bool:
    """Whether no run holds, or may still hold, the lock of ``output_dir``; judged without writing anything.

    False when its ``flock`` is taken or the file names a holder (a live run, or a dead one whose lock
    :meth:`RunLock.acquire` takes over): :class:`RunLock` says those.
    """
    try:
        fd = os.open(lock_path(output_dir), os.O_RDONLY)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return not os.read(fd, 1)
    except OSError:
        return False
    finally:
        os.close(fd)  # drops the shared flock with it


def export_lock_path(export_dir: str | os.PathLike) -> Path:
    """The lock file of the export directory ``export_dir``: beside it, named after it.

    Example:
        >>> export_lock_path("outputs/run/export").name
        '.neutrain-export-export.lock'
    """
    path = Path(os.path.abspath(export_dir))
    return path.with_name(f".neutrain-export-{path.name}.lock")


def release(output_dir: str | os.PathLike) -> None:
    """Release this process's lock on the run directory ``output_dir``, if it holds one (a no-op otherwise).

    The file is emptied, so the next run finds no holder to check, and kept (see the module doc).
    """
    _release(lock_path(output_dir))


def release_export(export_dir: str | os.PathLike) -> None:
    """Release this process's lock on the export directory ``export_dir``, if it holds one, deleting its file."""
    path = export_lock_path(export_dir)
    if os.path.realpath(path) in _HELD:
        try:
            os.unlink(path)  # while the flock is held: nobody else can hold this inode now
        except OSError:
            pass
    _release(path)


def holds(output_dir: str | os.PathLike) -> bool:
    """Whether this process holds the lock of the run directory ``output_dir``."""
    return os.path.realpath(lock_path(output_dir)) in _HELD


def _release(path: Path) -> None:
    fd = _HELD.pop(os.path.realpath(path), None)
    if fd is None:
        return
    try:
        os.ftruncate(fd, 0)
    except OSError:  # a full or read-only disk: the flock still goes with the fd
        pass
    os.close(fd)


def names_in(directory: str | os.PathLike) -> list[str]:
    """The names in ``directory``; none when it is missing or not a directory."""
    try:
        return os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []


def previous_checkpoints(output_dir: str | os.PathLike) -> list[str]:
    """The ``checkpoint-N`` directories in ``output_dir``, sorted by step."""
    names = names_in(output_dir)
    found = [n for n in names if CHECKPOINT_NAME.fullmatch(n) and os.path.isdir(os.path.join(output_dir, n))]
    return sorted(found, key=lambda n: int(n.split("-")[1]))


def refuse_linked_checkpoints(run_dir: str | os.PathLike) -> None:
    """Refuse a ``checkpoint-N`` in ``run_dir`` that is a symbolic link, naming it.

    Why: saving moves the checkpoint of the same step aside and deletes it, and rotation deletes old
    ones; through a link that meant deleting (or failing to delete: "Cannot call rmtree on a symbolic
    link", with no path) a directory outside the run, and a save stopped halfway left its temporaries.
    """
    if not os.path.isdir(run_dir):
        return
    for entry in sorted(os.listdir(run_dir)):
        path = os.path.join(run_dir, entry)
        if entry.startswith("checkpoint-") and os.path.islink(path):
            raise CheckpointError(f"{path} is a symbolic link (to {os.readlink(path)}); neutrain does not replace or "
                                  f"delete checkpoints through links: move that checkpoint into {run_dir}, or remove the link")
