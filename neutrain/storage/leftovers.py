"""Find and clear the temporary names neutrain itself writes, left behind by kills, full disks and failures.

neutrain writes every checkpoint, export, recipe copy, tokenizer and data cache under a
temporary name and renames it into place, so an interrupted write never looks finished.
What an interruption leaves is the temporary name. This module knows those names exactly
(:data:`RUN_DIR_PATTERNS`, :func:`export_leftover_patterns`) and touches nothing else:
a file the user put in the directory is never matched, whatever it is called.

Two kinds of leftover:

* a half-written temporary (``.tmp-checkpoint-N``, ``recipe.tmp<pid>``, ...) is removed;
* a previous version moved aside while its replacement was renamed in
  (``.tmp-old-checkpoint-N``, ``.tmp-old-<export>-<pid>``) is complete. It is put back
  when the replacement never arrived, and removed when the replacement is in place.

Names carrying a process id are kept while that process is alive (another neutrain may
be writing them right now); this process's own are stale by the time a start or a
failure cleans up. A temporary checkpoint directory names its writer in a
``writer.json`` inside it (pid, host, start time: :func:`mark_writer`), and is kept while
that writer lives on this host; the run lock (:mod:`neutrain.storage.run_lock`) keeps
any other run from cleaning while its writer runs. The module imports nothing from
neutrain, so any layer may use it.

Example:
    >>> from neutrain.storage.leftovers import clean_run_dir
    >>> clean_run_dir("outputs/run")  # doctest: +SKIP
    ['removed outputs/run/.tmp-checkpoint-40 (temporary left by an interrupted or failed write)']
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import time
from pathlib import Path

from neutrain.files import read_json_object

logger = logging.getLogger("neutrain")

# What each temporary name is (the pattern must match the whole name). Written by:
#   .tmp-checkpoint-N      NeuTrainer._save_checkpoint (the checkpoint being written)
#   .tmp-old-checkpoint-N  NeuTrainer._save_checkpoint (checkpoint-N moved aside while it is replaced)
#   recipe.tmp<pid>        run._save_recipe
#   summary.json.tmp<pid>  the summary a run writes last (storage.durable.write_durably)
#   tokenizer.tmp<pid>     modeling.build_tokenizer (byte / train-bpe tokenizers)
#   .cache/python-stdlib-<hash>.tmp<pid>   data.sources.python_stdlib_corpus
RUN_DIR_PATTERNS: tuple[tuple[str, str], ...] = (
    ("", r"\.tmp-checkpoint-(?P<step>\d+)"),
    ("", r"\.tmp-old-(?P<restore>checkpoint-\d+)"),
    ("", r"recipe\.tmp(?P<pid>\d+)"),
    ("", r"summary\.json\.tmp(?P<pid>\d+)"),
    ("", r"tokenizer\.tmp(?P<pid>\d+)"),
    (".cache", r"python-stdlib-[0-9a-f]{12}\.tmp(?P<pid>\d+)"),
)


WRITER_FILE = "writer.json"


def this_writer() -> dict:
    """Who this process is, as a lock file and a temporary's ``writer.json`` record it.

    ``process`` (where the system tells it) tells this process from a later one that reuses its pid.
    """
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    identity = process_identity(os.getpid())
    if identity is not None:
        record["process"] = identity
    return record


def process_identity(pid: int) -> str | None:
    """``"<boot id>:<start time in clock ticks>"`` of process ``pid`` (Linux), else None.

    Why: a pid is reused once its process has ended; a lock or a temporary that names a dead run's pid,
    now taken by an unrelated process, must not count as held by a live run forever. The start time
    since boot, with the boot's id, is the same only for the same process.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            boot = fh.read().strip()
        return f"{boot}:{int(fields[19])}"  # field 22 of stat: starttime (fields[0] here is field 3)
    except (OSError, IndexError, ValueError):
        return None


def writer_alive(record: dict, holding: str | os.PathLike | None = None) -> bool:
    """Whether the process a lock or ``writer.json`` record names still runs on this host (the same process,
    where its start time was recorded: not a later one that took its pid).

    A record in the previous release's format names only a pid, and a pid alive now is often another
    process's (a container's ``pid 1``, or one reused since): such a record blocked every run with "pid 1
    on host vm". Its process counts as the writer only if it has ``holding`` open (a run keeps its lock
    file open for its whole life), or, where that cannot be read or there is no such file, only if its
    command line could be neutrain's.
    """
    pid = record.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or not _alive(pid):
        return False
    recorded, now = record.get("process"), process_identity(pid)
    if recorded is not None:
        return now is None or recorded == now
    held = holds_open(pid, holding) if holding is not None else None
    return held if held is not None else _could_be_neutrain(pid)


def holds_open(pid: int, path: str | os.PathLike) -> bool | None:
    """Whether process ``pid`` has the file ``path`` open (Linux ``/proc``), or None where that cannot be read.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile() as fh:
        ...     holds_open(os.getpid(), fh.name)
        True
    """
    try:
        target = os.stat(path)
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for name in names:
        try:
            info = os.stat(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if (info.st_dev, info.st_ino) == (target.st_dev, target.st_ino):
            return True
    return False


def _could_be_neutrain(pid: int) -> bool:
    """Whether ``pid``'s command line could be a neutrain run's (True where it cannot be read: a live pid counts)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            command = fh.read().replace(b"\0", b" ").lower()
    except OSError:
        return True
    return any(word in command for word in (b"neutrain", b"python", b"accelerate", b"torchrun", b".yaml", b".yml"))


def mark_writer(temporary: str | os.PathLike) -> None:
    """Create the temporary directory ``temporary`` and name this process in it as its writer.

    Example:
        >>> mark_writer("outputs/run/.tmp-checkpoint-10")  # doctest: +SKIP
    """
    os.makedirs(temporary, exist_ok=True)
    with open(os.path.join(temporary, WRITER_FILE), "w", encoding="utf-8") as fh:
        json.dump(this_writer(), fh)


def _live_writer(path: Path) -> int | None:
    """The pid of the live process on this host that ``path/writer.json`` names, else None."""
    try:
        writer = read_json_object(path / WRITER_FILE, f"writer record '{path / WRITER_FILE}'", ValueError)
        host = writer["host"]
    except (ValueError, KeyError):
        return None  # no record (an older neutrain), or torn by the kill that left it
    return writer["pid"] if host == socket.gethostname() and writer_alive(writer) else None


def export_leftover_patterns(name: str) -> tuple[str, ...]:
    """The temporary names ``neutrain.export`` writes beside the export directory ``name``."""
    escaped = re.escape(name)
    return (rf"\.tmp-{escaped}-(?P<pid>\d+)", rf"\.tmp-old-(?P<restore>{escaped})-(?P<pid>\d+)")


def clean_run_dir(output_dir: str | os.PathLike) -> list[str]:
    """Clear neutrain's leftover temporaries in a run's ``output_dir``; returns one line per action (logged too).

    Call it on the main process before anything else writes into ``output_dir``.
    """
    root = Path(output_dir)
    actions: list[str] = []
    for sub, pattern in RUN_DIR_PATTERNS:
        actions += _clean(root / sub if sub else root, (pattern,))
    return actions


def clean_export_leftovers(output_dir: str | os.PathLike) -> list[str]:
    """Clear the temporaries an earlier (or this process's failed) export left beside ``output_dir``."""
    out = Path(output_dir)
    return _clean(out.parent, export_leftover_patterns(out.name))


def restore_set_aside_export(output_dir: str | os.PathLike) -> list[str]:
    """Put back a previous export an interrupted replacement set aside beside ``output_dir`` (its half-written
    successor, if any, is left to :func:`clean_export_leftovers`)."""
    out = Path(output_dir)
    return _clean(out.parent, export_leftover_patterns(out.name)[1:])


def _clean(directory: Path, patterns: tuple[str, ...]) -> list[str]:
    try:
        entries = sorted(os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    actions = []
    for name in entries:
        match = next((m for m in (re.fullmatch(p, name) for p in patterns) if m), None)
        if match is None:
            continue
        groups = match.groupdict()
        path = directory / name
        writer = int(groups["pid"]) if groups.get("pid") and _alive(int(groups["pid"])) else _live_writer(path)
        if writer is not None:
            logger.info("kept %s: process %s that writes it is running", path, writer)
            continue
        restore = groups.get("restore")
        if restore and not (directory / restore).exists():
            os.replace(path, directory / restore)
            action = (f"restored {directory / restore} from {name}: an interrupted replacement had set it aside, and "
                      f"its successor never arrived")
        else:
            _remove(path)
            action = f"removed {path} (temporary left by an interrupted or failed write)"
        logger.warning("%s", action)
        actions.append(action)
    return actions


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process is starting or failing now: its own old temporaries are stale
    return pid_alive(pid)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (another user's process counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except OverflowError:
        return False
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
