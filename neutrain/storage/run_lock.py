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
* :func:`check_new_run` refuses a fresh run (no resume) into a directory that holds
  another run's ``checkpoint-N`` unless ``train.overwrite_output_dir`` is set, and
  :func:`clear_previous_run` then removes that run's outputs, so nothing is mixed.

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
import shutil
import socket
from pathlib import Path

from neutrain.errors import CheckpointError, UserInputError
from neutrain.storage.leftovers import this_writer, writer_alive
from neutrain.storage.manifest import EXPORT_INFO

logger = logging.getLogger("neutrain")

LOCK_FILE = ".neutrain.lock"
CHECKPOINT_NAME = re.compile(r"checkpoint-\d+")
# What a run writes at the top of its output_dir, removed with its checkpoints by train.overwrite_output_dir
# (its tokenizer too: a train-bpe vocabulary belongs to the data it was trained on), so that nothing of the old
# run is left to be taken for the new one's: `neutrain generate RUN/export` served the previous model.
RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "training_curves.png", "tokenizer", "recipe.yaml", "eval", "distill")
# Model directories a run writes there (the export, the draft, a LoRA run's frozen base): removed only when
# they are neutrain's (neutrain_export.json inside); anything else is the user's and the run refuses to touch it.
RUN_MODEL_DIRS = ("export", "draft", "base")

_HELD: dict[str, int] = {}  # real path of output_dir -> fd of the lock this process holds on it


class RunDirectoryError(UserInputError):
    """The output directory belongs to another run (live, or whose checkpoints a new run would overwrite)."""


def _holder_text(holder: dict) -> str:
    if not holder:  # being written this instant, or torn
        return "its pid and host are not written yet"
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"


class RunLock:
    """The lock of one output directory, held from :meth:`acquire` to :meth:`release` (or process exit).

    Raises :class:`RunDirectoryError` (one line, naming the holder and the lock file) when
    another live run holds it.
    """

    def __init__(self, output_dir: str | os.PathLike):
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_FILE
        self._took = False  # whether this object took the lock (a no-op acquire must not release another's)

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        if self._took:
            self.release()

    def acquire(self) -> "RunLock":
        """Take the lock (creating ``output_dir``); a no-op when this process holds it already."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        key = os.path.realpath(self.output_dir)
        if key in _HELD:  # this process already runs here
            return self
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise RunDirectoryError(self._in_use(self._read(fd))) from None
            self._take_over(fd)
        except BaseException:
            os.close(fd)
            raise
        _HELD[key] = fd
        self._took = True
        return self

    def _in_use(self, holder: dict) -> str:
        return (f"train.output_dir '{self.output_dir}' is in use by another neutrain run ({_holder_text(holder)}; "
                f"lock {self.path}): wait for it to end, or choose another train.output_dir")

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
            if holder.get("host") != socket.gethostname():
                raise RunDirectoryError(
                    f"train.output_dir '{self.output_dir}' is locked by a neutrain run on another host "
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
        release(self.output_dir)


def release(output_dir: str | os.PathLike) -> None:
    """Release this process's lock on ``output_dir``, if it holds one (a no-op otherwise).

    The file is emptied, so the next run finds no holder to check, and kept (see the module doc).
    """
    fd = _HELD.pop(os.path.realpath(output_dir), None)
    if fd is None:
        return
    try:
        os.ftruncate(fd, 0)
    except OSError:  # a full or read-only disk: the flock still goes with the fd
        pass
    os.close(fd)


def previous_checkpoints(output_dir: str | os.PathLike) -> list[str]:
    """The ``checkpoint-N`` directories in ``output_dir``, sorted by step."""
    try:
        names = os.listdir(output_dir)
    except (FileNotFoundError, NotADirectoryError):
        return []
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


def check_new_run(output_dir: str | os.PathLike, overwrite: bool) -> list[str]:
    """Refuse a fresh run into a directory holding another run's checkpoints, unless ``overwrite``; returns them."""
    refuse_linked_checkpoints(output_dir)  # named as the link it is, before it counts as another run's
    found = previous_checkpoints(output_dir)
    if found and not overwrite:
        raise RunDirectoryError(
            f"train.output_dir '{output_dir}' holds another run's checkpoints ({', '.join(found[-3:])}): a new run "
            f"would mix its metrics and checkpoints with them. Resume it with train.resume_from_checkpoint=true, "
            f"choose another train.output_dir, or set train.overwrite_output_dir=true to delete them")
    return found


def clear_previous_run(output_dir: str | os.PathLike, checkpoints: list[str]) -> None:
    """Delete a previous run's checkpoints and every other output it wrote in ``output_dir``
    (``train.overwrite_output_dir``), each logged; a model directory that is not neutrain's is kept."""
    root = Path(output_dir)
    models = [name for name in RUN_MODEL_DIRS if (root / name / EXPORT_INFO).is_file() and not (root / name).is_symlink()]
    for name in [*checkpoints, *RUN_OUTPUTS, *models]:
        path = root / name
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
        else:
            continue
        logger.warning("train.overwrite_output_dir: deleted %s of the previous run", path)
