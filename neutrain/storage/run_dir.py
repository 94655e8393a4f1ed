"""A run's directory and what it owns: an identity file that names the run, and the list of every name it wrote.

Why: a run used to judge a directory by what it held. A first run into a folder holding the
user's ``recipe.yaml`` and ``tokenizer/`` replaced both; ``train.overwrite_output_dir`` deleted a
user's ``eval/`` and ``distill/`` as "of the previous run" from a folder no run had used; a
symlinked ``train.output_dir`` re-pointed during the run sent the later checkpoints there, and the
rotation deleted that folder's own ``checkpoint-1``.

Now a run writes only into an empty directory or its own run, and deletes only what it wrote:

* ``.neutrain-run`` (JSON lines, :data:`IDENTITY`) is written into the directory when its first
  run starts: line one names the run (a random id) and the recipe it was started with; every
  name the run then creates at the top of the directory is appended as ``{"wrote": name}``
  (:func:`claim`) before it is written. Lines are only appended (``O_APPEND``), so ``neutrain
  eval`` beside a training run adds its names without losing the run's; a line torn by a kill is
  skipped.
* A directory with no identity file is the run's only while it is empty (the lock file aside).
* The directory is resolved once (its real path, symlinks followed) and its identity, device and
  inode, is kept: before anything is claimed, rotated or deleted, :meth:`OpenRun.verify` checks
  that the path still names that directory.
* An overwrite (:func:`clear_owned`) and the checkpoint rotation (:func:`rotate_owned`) delete
  only names the list holds.

Example:
    >>> import tempfile
    >>> root = tempfile.mkdtemp()
    >>> run = open_run(root, {"train": {"seed": 1}})
    >>> run.claim("metrics.jsonl"); run.owns("metrics.jsonl"), run.owns("notes")
    (True, False)
    >>> close_run(root)
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from neutrain.files import folder_kind_trouble, read_bytes
from neutrain.storage.confine import FILE_OUTPUTS  # the files among PLANNED (the rest are directories)
from neutrain.storage.durable import fsync_dir, write_durably
from neutrain.storage.leftovers import WRITER_FILE
from neutrain.storage.manifest import EXPORT_INFO, MANIFEST, foreign_files, written_with_manifest
from neutrain.storage.run_lock import CHECKPOINT_NAME, RunDirectoryError, names_in, previous_checkpoints

logger = logging.getLogger("neutrain")

IDENTITY = ".neutrain-run"
FORMAT = "neutrain-run-dir-1"
_MAX_BYTES = 16 << 20  # a line per name: far below this for any run
# What a run may write at the top of its directory besides checkpoint-N (checked before it trains).
PLANNED = ("recipe.yaml", "metrics.jsonl", "summary.json", "training_curves.png", "training_args.json", "tokenizer",
           ".cache", "eval", "export", "draft", "distill", "base")
# Model directories a run writes (deleted by an overwrite only while they still hold a neutrain model).
MODEL_DIRS = ("export", "draft", "base")
# Content-addressed (keyed by the data's hash), so as valid for the next run as for the last: an overwrite keeps it.
KEPT_ON_OVERWRITE = (".cache",)
# Names that are neutrain's own whatever the list says: the lock, this file, and temporaries it clears itself.
_HOUSEKEEPING = re.compile(r"\.neutrain\.lock|\.neutrain-run(\.tmp\d+)?|\.neutrain-write-probe-.*|\.tmp-.*|"
                           r"\.neutrain-export-.*\.lock")


class Ledger:
    """What ``.neutrain-run`` says: the run's id, the recipe it was started with, the names it wrote."""

    def __init__(self, run: str, recipe: Any, wrote: list[str]):
        self.run, self.recipe, self.wrote = run, recipe, wrote


def read_ledger(root: str | os.PathLike) -> Ledger | None:
    """The ledger of the run in ``root``; None when it has no identity file.

    Raises:
        RunDirectoryError: an identity file that is not one (corrupt or replaced), naming it.
    """
    path = Path(root) / IDENTITY
    try:
        if path.stat().st_size > _MAX_BYTES:
            raise RunDirectoryError(f"'{path}' has {path.stat().st_size:,} bytes, more than a run's identity file "
                                    f"holds: it is not neutrain's; move it out of the run directory")
        # Through the bounded reader: a FIFO in its place has size 0 and would block a plain read.
        lines = read_bytes(path, f"'{path}'", _MAX_BYTES, RunDirectoryError).decode("utf-8", errors="replace").splitlines()
    except (FileNotFoundError, NotADirectoryError):  # no run there (or no directory at all: its check names it)
        return None
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # torn by a kill while it was appended
        if isinstance(record, dict):
            records.append(record)
    if not records or records[0].get("format") != FORMAT or not isinstance(records[0].get("run"), str):
        raise RunDirectoryError(f"'{path}' is not a neutrain run identity (corrupt or replaced): neutrain cannot tell "
                                f"which files of {root} its run wrote; delete that file to start afresh there")
    ledger = Ledger(records[0]["run"], records[0].get("recipe"), [])
    for record in records[1:]:
        if isinstance(record.get("wrote"), str) and record["wrote"] not in ledger.wrote:
            ledger.wrote.append(record["wrote"])
        if "recipe" in record:
            ledger.recipe = record["recipe"]
    return ledger


def write_identity(root: str | os.PathLike, recipe: Any, wrote: list[str] = ()) -> Ledger:
    """Start a new run in ``root``: a fresh identity (a new id, ``recipe``) listing ``wrote``; synced."""
    ledger = Ledger(uuid.uuid4().hex, recipe, list(dict.fromkeys(wrote)))
    head = {"format": FORMAT, "run": ledger.run, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "recipe": recipe}
    lines = [json.dumps(head, default=str)] + [json.dumps({"wrote": name}) for name in ledger.wrote]
    path = Path(root) / IDENTITY
    write_durably(path, "\n".join(lines) + "\n", tmp=f"{path}.tmp{os.getpid()}")
    _OPEN.pop(os.path.realpath(root), None)  # a run held here before is another run now
    return ledger


def _append(root: Path, record: dict) -> None:
    fd = os.open(root / IDENTITY, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, (json.dumps(record, default=str) + "\n").encode())  # one write: appends never interleave
        os.fsync(fd)
    finally:
        os.close(fd)


def entries(root: str | os.PathLike) -> list[str]:
    """The names in ``root`` other than neutrain's housekeeping (lock, identity, temporaries it clears)."""
    return sorted(n for n in names_in(root) if not _HOUSEKEEPING.fullmatch(n))


def is_housekeeping(name: str) -> bool:
    """Whether ``name`` (at the top of a run directory) is neutrain's own: its lock, identity or a temporary."""
    return bool(_HOUSEKEEPING.fullmatch(name))


class OpenRun:
    """The directory of the run this process is writing: held by its identity, with the names it owns."""

    def __init__(self, root: str | os.PathLike, ledger: Ledger):
        self.given = os.path.abspath(root)
        self.root = Path(os.path.realpath(root))
        st = os.stat(self.root)
        self.identity = (st.st_dev, st.st_ino)
        self.ledger = ledger
        self.kept: set[str] = set()  # checkpoints the rotation keeps for a file the run did not write (said once)

    def verify(self) -> None:
        """Refuse to go on when the path no longer names the directory the run started in."""
        try:
            st = os.stat(self.root)
            same = (st.st_dev, st.st_ino) == self.identity
        except OSError:
            same = False
        if not same:
            raise RunDirectoryError(f"the run directory {self.root} is no longer the directory this run started in "
                                    f"(moved, removed or replaced while the run went on): nothing more is written or "
                                    f"deleted there")

    def owns(self, name: str) -> bool:
        return name in self.ledger.wrote

    def claim(self, name: str) -> None:
        """Record ``name`` (top level) as the run's before it is written; refused when it exists and is not."""
        self.verify()
        if name in self.ledger.wrote or _HOUSEKEEPING.fullmatch(name):
            return
        path = self.root / name
        if path.exists() or path.is_symlink():
            raise RunDirectoryError(f"'{path}' exists and this run did not write it: neutrain writes only into an empty "
                                    f"directory or its own run, never over files it did not write; move it elsewhere")
        _append(self.root, {"wrote": name})
        self.ledger.wrote.append(name)

    def set_recipe(self, recipe: Any) -> None:
        """Record that a later launch continues this directory with ``recipe``."""
        if recipe is not None and recipe != self.ledger.recipe:
            _append(self.root, {"recipe": recipe})
            self.ledger.recipe = recipe


_OPEN: dict[str, OpenRun] = {}  # real path -> the run this process writes there


def open_run(root: str | os.PathLike, recipe: Any = None, create: bool = True) -> OpenRun | None:
    """Hold ``root`` as this process's run: its ledger, or a new identity when ``root`` is empty (and ``create``).

    Returns None (nothing held) for a directory that is neither: a caller that checked ownership
    already refused it; :class:`~neutrain.trainer.trainer.NeuTrainer` used on its own writes there
    unlisted, as before. ``create=False`` (a command working for a run, without its lock) holds only a
    directory a run already marked.
    """
    key = os.path.realpath(root)
    ledger = read_ledger(root) if os.path.isdir(root) else None  # read afresh: another run may have started here
    if ledger is None:
        if not create or not os.path.isdir(root) or entries(root):
            return None
        ledger = write_identity(root, recipe)
    run = _OPEN[key] = OpenRun(root, ledger)
    return run


def close_run(root: str | os.PathLike) -> None:
    """Stop holding ``root`` (a no-op when this process holds nothing there)."""
    _OPEN.pop(os.path.realpath(root), None)


def close_all() -> None:
    """Stop holding every run directory (the end of a command)."""
    _OPEN.clear()


def held(path: str | os.PathLike) -> tuple[OpenRun, str] | None:
    """``(run, top-level name)`` when ``path`` lies inside a run this process holds, else None."""
    absolute = os.path.abspath(path)
    for run in _OPEN.values():
        for base in (run.given, str(run.root)):
            if absolute.startswith(base.rstrip(os.sep) + os.sep):
                return run, os.path.relpath(absolute, base).split(os.sep)[0]
    return None


def claim(path: str | os.PathLike) -> None:
    """Record the top-level name ``path`` lies under as written by the held run there (a no-op elsewhere)."""
    found = held(path)
    if found is not None:
        found[0].claim(found[1])


def verify(path: str | os.PathLike) -> None:
    """Refuse when the held run ``path`` lies in was moved or replaced (a no-op outside a held run)."""
    found = held(path)
    if found is not None:
        found[0].verify()


def owned_checkpoints(root: str | os.PathLike, ledger: Ledger) -> list[str]:
    """The ``checkpoint-N`` of ``root`` its ledger lists, by step."""
    return [name for name in previous_checkpoints(root) if name in ledger.wrote]


def unowned_planned(root: str | os.PathLike, ledger: Ledger | None, planned: tuple[str, ...] = PLANNED) -> list[str]:
    """The names a run plans to write (``planned``, ``checkpoint-N``) that exist in ``root`` and it did not write."""
    wrote = ledger.wrote if ledger is not None else []
    return [name for name in entries(root)
            if (name in planned or CHECKPOINT_NAME.fullmatch(name)) and name not in wrote]


def clear_owned(root: str | os.PathLike, ledger: Ledger) -> list[str]:
    """Delete everything ``ledger`` lists in ``root`` (``train.overwrite_output_dir``); returns what went, each logged.

    A model directory the list names is deleted only while it still holds a neutrain model (a directory
    the user put there since is kept), the data cache is kept (:data:`KEPT_ON_OVERWRITE`), and nothing
    the list does not name is touched.
    """
    targets = []
    for name in ledger.wrote:
        if name in KEPT_ON_OVERWRITE:
            continue
        path = Path(root) / name
        if name in FILE_OUTPUTS and path.is_dir() and not path.is_symlink():
            continue  # a file the run wrote, replaced by a directory since: the user's now
        is_model = name in MODEL_DIRS or CHECKPOINT_NAME.fullmatch(name)
        if is_model and not path.is_symlink() and not any((path / f).is_file() for f in (EXPORT_INFO, MANIFEST,
                                                                                          "trainer_state.json")):
            continue
        if path.is_symlink() or path.is_file() or path.is_dir():
            targets.append((name, path))
    # Checked for all before any goes: a refusal deletes nothing.
    foreign = [f for _, path in targets for f in foreign_files(path)]
    if foreign:
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        raise RunDirectoryError(f"train.overwrite_output_dir: '{foreign[0]}'{more} was not written by the previous "
                                f"run, and the overwrite would delete it with the folder it is in: nothing was "
                                f"deleted; move it out of '{root}', or choose another train.output_dir")
    removed = []
    for name, path in targets:
        if path.is_symlink() or path.is_file():
            path.unlink()
        else:
            shutil.rmtree(path)
        removed.append(name)
        logger.warning("train.overwrite_output_dir: deleted %s, written by the previous run", path)
    fsync_dir(root)
    return removed


def rotate_owned(run: OpenRun, limit: int | None, keep: tuple[str, ...] = ()) -> list[str]:
    """Delete the oldest checkpoints the run wrote beyond ``limit`` (never the newest, nor one in ``keep``).

    Only checkpoints the run's list names count and go: one the user put there is neither counted nor deleted,
    nor is one the user put a file into (:func:`~neutrain.storage.manifest.foreign_files`).
    """
    run.verify()
    if not limit or limit <= 0:
        return []
    mine = owned_checkpoints(run.root, run.ledger)
    protected = {mine[-1], *(os.path.basename(os.path.normpath(k)) for k in keep if k)} if mine else set()
    # A checkpoint holding a file the run did not write is kept whole and not counted: the file would go with it.
    foreign = {name: found[0] for name in mine if name not in protected and (found := foreign_files(run.root / name))}
    for name, found in foreign.items():
        if name not in run.kept:
            run.kept.add(name)
            logger.warning("train.save_total_limit: kept %s, which holds %s (not written by the run); move that out "
                           "and delete the checkpoint yourself", run.root / name, found)
    counted = [name for name in mine if name not in foreign]
    keep_count = max(limit, len(protected & set(counted)))
    removed = []
    for name in counted:
        if len(counted) - len(removed) <= keep_count:
            break
        if name not in protected:
            shutil.rmtree(run.root / name, ignore_errors=True)
            removed.append(name)
    return removed


def legacy_run(root: str | os.PathLike) -> bool:
    """Whether ``root`` (no identity file) holds checkpoints an earlier neutrain wrote (they carry its manifest)."""
    return any(written_with_manifest(Path(root) / name) for name in previous_checkpoints(root))


# What marks a directory as a model neutrain (or the Trainer) wrote: a checkpoint, an export, a checkpoint being written.
MODEL_MARKS = (MANIFEST, EXPORT_INFO, "neutrain_run.json", "trainer_state.json", "neutrain_weights.json", WRITER_FILE)


def enclosing_model(path: str | os.PathLike) -> Path | None:
    """The nearest directory at or above ``path`` (symlinks followed) that is a checkpoint or an export, else None.

    Example:
        >>> import tempfile
        >>> enclosing_model(tempfile.mkdtemp() + "/out") is None
        True
    """
    real = Path(os.path.realpath(path))
    for directory in (real, *real.parents):
        if directory.is_dir() and any((directory / mark).is_file() for mark in MODEL_MARKS):
            return directory
    return None


def enclosing_run(path: str | os.PathLike) -> Path | None:
    """The nearest directory strictly above ``path`` (symlinks followed) that is a run's (it holds :data:`IDENTITY`),
    else None. ``path`` itself being a run is not counted: that is the run resumed, relaunched or evaluated.

    Example:
        >>> import tempfile
        >>> enclosing_run(tempfile.mkdtemp() + "/out") is None
        True
    """
    real = Path(os.path.realpath(path))
    return next((directory for directory in real.parents if (directory / IDENTITY).is_file()), None)


def refuse_inside_model(path: str | os.PathLike, key: str, may_be_one: bool = False,
                        own: str | os.PathLike | None = None) -> None:
    """Refuse an output ``path`` (named ``key``) that cannot be a folder (a FIFO, a device), that lies inside a
    checkpoint or export, or inside another run's folder; ``may_be_one``: ``path`` itself may be a model (an export
    replacing a previous export), but not lie inside another; ``own``: the run whose folder ``path`` may lie in
    (a run's own export).

    Why: ``train.output_dir=RUN/checkpoint-2`` wrote a whole run inside another run's checkpoint, which then no
    longer verified, and RUN no longer resumed; ``RUN/newsub`` wrote a run inside a folder RUN's overwrite and
    rotation own, unlisted; ``/dev/null`` was "not writable: Not a directory", exit 1.
    """
    if trouble := folder_kind_trouble(path):
        raise RunDirectoryError(f"{key}: '{path}' {trouble}; name a directory")
    real = Path(os.path.realpath(path))
    model = enclosing_model(real.parent if may_be_one else real)
    if model is not None:
        what = "export" if (model / EXPORT_INFO).is_file() else "checkpoint"
        raise RunDirectoryError(f"{key} '{path}' lies inside the {what} {model}: writing there would change that "
                                f"{what} (it would no longer verify or load); choose a directory outside it")
    run = enclosing_run(real)
    if run is not None and (own is None or Path(os.path.realpath(own)) != run):
        raise RunDirectoryError(f"{key} '{path}' lies inside the run {run} (it holds {IDENTITY}): that folder holds "
                                "what its run writes, which overwrites and rotates it; choose a directory outside it")
