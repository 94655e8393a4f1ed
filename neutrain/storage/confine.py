"""Nothing read or written outside the run or checkpoint directory: symlinks and paths that leave it are refused.

Why: ``summary.json``, ``metrics.jsonl`` and ``training_curves.png``
were written through symlinks pointing outside the run directory; manifest entries such as
``../../etc/passwd`` or absolute paths were read, which made export, resume and eval a
size and hash oracle for any readable file; and a ``model.safetensors`` symlinked outside
its checkpoint was loaded silently.

The same holds for the files a checkpoint names inside itself: a sharded
``model.safetensors.index.json`` maps tensors to shard files, and a foreign export's
index mapping them to ``../..`` or an absolute path made ``generate``, ``export`` and
``eval`` read (and ``export`` copy) any safetensors file on disk; :func:`indexed_files`
confines every shard it names before any is opened.

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
import re
import stat
from pathlib import Path, PurePosixPath

from neutrain.errors import CheckpointError
from neutrain.files import kind_word, read_json_object

# What a run writes at the top of its output_dir (neutrain.cli.train, neutrain.trainer.callbacks, ...): files it
# appends to or replaces, and folders it fills ("runs": TensorBoard's events, where train.report_to asks for them).
FILE_OUTPUTS = ("recipe.yaml", "metrics.jsonl", "summary.json", "training_curves.png", "training_args.json")
DIR_OUTPUTS = ("tokenizer", ".cache", "eval", "export", "draft", "distill", "base", "runs")
RUN_FILES = FILE_OUTPUTS + DIR_OUTPUTS
# What makes a name at the top of a run neutrain's own besides those: its checkpoints, and its lock, identity file
# and temporaries.
_OWN_NAME = re.compile(r"checkpoint-\d+|\.neutrain.*|\.tmp-.*")
# What marks a folder as a model (a checkpoint or an export): a file written into it changes what it verifies as.
_MODEL_MARKS = ("neutrain_manifest.json", "neutrain_export.json", "trainer_state.json", "neutrain_run.json")


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
    """``path`` (an output of the run in ``root``), refused when what stands there would send the run's write
    elsewhere: a symlink leading outside ``root``, or onto another of the run's outputs, its checkpoints or a
    model; a folder where the run writes a file or a file where it fills a folder; a file with other names
    (a hard link), which a write in place changes under those names too.

    Why: only links leading outside were refused, so ``training_curves.png -> checkpoint-2/model.safetensors``
    wrote the plot over the checkpoint's weights at the end of a resumed run (exit 0), a hard-linked
    ``metrics.jsonl`` (a run copied with ``cp -al``) grew under both runs, and a folder named ``summary.json``
    failed as "Is a directory" after all the training.

    Example:
        >>> import tempfile
        >>> root = tempfile.mkdtemp()
        >>> check_output(f"{root}/summary.json", root).name
        'summary.json'
    """
    path = Path(path)
    if not (path.is_symlink() or path.exists()):
        return path
    if not _within(path, root):
        raise ConfinementError(f"'{path}' is a symlink to {os.path.realpath(path)}, outside the run directory "
                               f"{root}: neutrain writes only inside it; remove the link")
    trouble = _output_trouble(path, Path(root))
    if trouble:
        raise ConfinementError(f"'{path}' {trouble}: nothing was written")
    return path


def _output_trouble(path: Path, root: Path) -> str | None:
    """Why the run may not write ``path`` (inside ``root``) as it stands, or None."""
    top = Path(os.path.realpath(root))
    real = Path(os.path.realpath(path))
    given = Path(os.path.abspath(path)).relative_to(os.path.abspath(root)).parts
    lands = real.relative_to(top).parts
    if real != Path(os.path.abspath(path)):  # a link on the way: where it lands must be no other output's
        if not lands:
            return f"is a symlink to the run directory {top} itself; remove the link"
        if lands[0] != given[0] and (lands[0] in RUN_FILES or _OWN_NAME.fullmatch(lands[0])):
            return (f"is a symlink to {real}, the run's own '{lands[0]}': writing through it would replace what the "
                    "run wrote there; remove the link")
        for folder in (real, *real.parents):
            if folder == top or top not in folder.parents:
                break
            if any((folder / mark).is_file() for mark in _MODEL_MARKS):
                return (f"is a symlink to {real}, inside the model {folder}: writing through it would change that "
                        "model (it would no longer verify or load); remove the link")
    try:
        info = os.stat(real)
    except OSError:
        return None  # gone meanwhile, or unreadable: the write names it
    wants_folder = len(given) == 1 and given[0] in DIR_OUTPUTS
    # A FIFO or a device is left to its reader and writer, which name it without opening it (no hang).
    if (stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode)) and wants_folder != stat.S_ISDIR(info.st_mode):
        wanted = "a folder" if wants_folder else "a file"
        return f"is {kind_word(info.st_mode)}, where the run writes {wanted}; move it out of the run directory"
    if stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
        return (f"is a file with {info.st_nlink} names (a hard link): the run writes it in place, which would change "
                "it under its other names too; give it its own copy (cp, not ln), or move it out")
    return None


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


INDEX_SUFFIX = ".safetensors.index.json"
_INDEX_BYTES = 64 << 20  # an index lists tensor names: megabytes for the largest models


def indexed_files(directory: str | os.PathLike, index: str = "model.safetensors.index.json") -> list[Path]:
    """The shard files ``directory/index`` names, each refused unless it is a file inside ``directory``.

    Raises:
        ConfinementError: a shard path with ``..``, an absolute path, or a symlink leading outside.
        CheckpointError: an index that is not JSON of the form ``{"weight_map": {tensor: file}}``.

    Example:
        >>> import json, tempfile
        >>> root = tempfile.mkdtemp()
        >>> _ = open(f"{root}/model.safetensors.index.json", "w").write(json.dumps({"weight_map": {"w": "../x.safetensors"}}))
        >>> try:
        ...     indexed_files(root)
        ... except ConfinementError as exc:
        ...     print("refused")
        refused
    """
    directory = Path(directory)
    path = directory / index
    weight_map = read_json_object(path, f"checkpoint file '{path}'", CheckpointError, _INDEX_BYTES).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"checkpoint file '{path}' is not a safetensors index (expected JSON with a "
                              f"\"weight_map\" of tensor names to shard file names)")
    shards = []
    for name, shard in sorted(weight_map.items(), key=lambda item: item[1]):
        try:
            shards.append(inside(directory, shard))
        except ConfinementError:
            raise ConfinementError(f"'{path}' maps tensor '{name}' to '{shard}', which leads outside {directory}: "
                                   f"refused (every shard must be a file inside the model directory)") from None
    return sorted(set(shards))


def check_indexes(directory: str | os.PathLike) -> None:
    """Confine the shards of every ``*.safetensors.index.json`` at the top of ``directory`` (:func:`indexed_files`).

    A hub id (not a local directory) is checked in its local cache's snapshot, where one is cached.

    Example:
        >>> import tempfile
        >>> check_indexes(tempfile.mkdtemp())  # no index: nothing to confine
    """
    root = Path(directory)
    if not root.is_dir():
        root = _cached_snapshot(str(directory))
        if root is None:
            return
    for index in sorted(root.glob(f"*{INDEX_SUFFIX}")):
        indexed_files(root, index.name)


def _cached_snapshot(repo_id: str) -> Path | None:
    """The local snapshot directory of a hub id whose index is cached, else None (nothing is downloaded)."""
    try:
        from huggingface_hub import try_to_load_from_cache  # lazy: only hub ids need it
    except ImportError:
        return None
    try:
        cached = try_to_load_from_cache(repo_id, "model.safetensors.index.json")
    except Exception:  # not a valid repo id: the loader names it
        return None
    return Path(cached).parent if isinstance(cached, str) else None
