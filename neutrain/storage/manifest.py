"""Trust nothing in a checkpoint: a checksum manifest, and a format check of every file before loading.

Two threats, two checks, both run before anything in a checkpoint is loaded
(resume, ``neutrain export``, ``neutrain eval``, ``load_checkpoint_model``):

* **Code in a file.** ``torch.load`` of a pickle runs whatever the pickle says.
  Every file must be one of: safetensors (its header parses and covers the file
  exactly), JSON (it parses), a torch file that loads with ``weights_only=True``
  (plain tensors and containers; numpy RNG state is allowlisted as the
  Trainer does), inert UTF-8 text (chat templates, model cards, licences) or a
  sentencepiece ``.model`` (a protobuf parsed as data). Anything else, e.g. ``torch.distributed.checkpoint``'s pickled ``.metadata``, is
  refused. The manifest does not replace this check: whoever can plant a file
  can rewrite the manifest too.
* **Silent corruption.** :func:`write_manifest` records every file's size and
  sha256 (a safetensors file's as its header's sha256 and each tensor's, which
  cover every byte and hash on threads), written last into the
  checkpoint, so a flipped byte in any tensor (dense weights, norms, biases,
  LoRA adapters, optimizer state) is named at load, file and tensor. A
  checkpoint written before manifests existed loads with a one-line warning;
  one written by a neutrain that writes manifests (:func:`written_with_manifest`
  finds the files only such a neutrain writes) but missing its manifest is
  damaged and refused: deleting the manifest must not switch the check off.

Example:
    >>> from neutrain.storage.manifest import verify_checkpoint, write_manifest
    >>> write_manifest("outputs/run/checkpoint-10")                  # doctest: +SKIP
    >>> verify_checkpoint("outputs/run/checkpoint-10",
    ...                   required=("trainer_state.json",))           # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from neutrain.compat.file_modes import honour_umask
from neutrain.errors import CheckpointError
from neutrain.files import MAX_FOLDER_TEXT_BYTES, MAX_RECORD_BYTES, kind_word, read_bytes, read_json_object, read_text
from neutrain.storage.confine import check_indexes, check_tree, inside
from neutrain.storage.digests import file_digests, remembered
from neutrain.storage.tensor_layout import safetensors_header

logger = logging.getLogger("neutrain")

MANIFEST = "neutrain_manifest.json"
MANIFEST_FORMAT = "neutrain-manifest-1"
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
# Read as text by tokenizers and model cards (or never read), never unpickled or executed.
TEXT_SUFFIXES = (".jinja", ".md", ".txt")
TEXT_NAMES = ("LICENSE", "NOTICE", ".gitattributes")
# sentencepiece's tokenizer.model is a protobuf the tokenizer parses as data.
DATA_SUFFIXES = (".model",)
EXPORT_INFO = "neutrain_export.json"
"""Written into every neutrain export (format and provenance); also what marks a directory as one."""
# Files that only a neutrain writing manifests writes beside a checkpoint's (or export's) weights.
WRITTEN_WITH_MANIFEST = ("neutrain_run.json", "training_args.json", EXPORT_INFO)
MANIFEST_MARK = "ChecksummedCheckpoint"
"""What such a neutrain also records in each checkpoint's ``trainer_state.json`` (a stateful callback's name:
:class:`neutrain.trainer.callbacks.ChecksummedCheckpoint`), the file a resume cannot do without."""
def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def _spans(path: Path) -> tuple[int, list[tuple[int, int, str]]]:
    """``(data start, spans)`` of safetensors file ``path``: each tensor's ``(first byte, end, name)`` in the
    file, in file order."""
    start, header = safetensors_header(path)
    return start, sorted((start + info["data_offsets"][0], start + info["data_offsets"][1], name)
                         for name, info in header.items() if name != "__metadata__")


def _digests(path: Path) -> tuple[str, dict[str, str]]:
    """sha256 of the whole file and, for safetensors, of each tensor's bytes (one read, hashed on threads:
    :mod:`neutrain.storage.digests`)."""
    spans = _spans(path)[1] if path.suffix == ".safetensors" else []
    try:
        return file_digests(path, spans)
    except EOFError:
        raise CheckpointError(f"checkpoint file '{path}' is truncated") from None


HEADER_DIGEST = "header_sha256"
"""A safetensors file's entry: sha256 of its first bytes up to the data (length and JSON header). With it and the
tensors' digests covering the data end to end, every byte is checked without the file's serial sha256."""


def _header_digest(path: Path, start: int) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read(start)).hexdigest()


def _tiled_spans(path: Path) -> tuple[int, list[tuple[int, int, str]]] | None:
    """``(data start, spans)`` of safetensors file ``path`` when its tensors cover its data with no byte between
    or after them (what neutrain and the safetensors library write), else None."""
    start, spans = _spans(path)
    pos = start
    for begin, stop, _ in spans:
        if begin != pos:
            return None
        pos = stop
    return (start, spans) if pos == path.stat().st_size else None


def _entry(path: Path) -> dict:
    """A file's manifest entry. A safetensors file whose tensors tile its data: its header's sha256 and each
    tensor's (every byte, and no serial pass over the file, written or checked); any other file: its sha256
    (and its tensors'). A file this process just wrote was hashed as it was written (without reading 89 GiB
    back); any other file, or one changed since, is read."""
    size = path.stat().st_size
    kept = remembered(path)
    tiled = _tiled_spans(path) if path.suffix == ".safetensors" else None
    if tiled is not None and tiled[1]:
        tensors = kept[1] if kept is not None else _tensor_digests(path, tiled[1])
        return {"size": size, HEADER_DIGEST: _header_digest(path, tiled[0]), "tensors": tensors}
    digest, tensors = kept if kept is not None and kept[0] is not None else _digests(path)
    return {"size": size, "sha256": digest, **({"tensors": tensors} if tensors else {})}


def _tensor_digests(path: Path, spans: list[tuple[int, int, str]]) -> dict[str, str]:
    try:
        return file_digests(path, spans, whole=False)[1]
    except EOFError:
        raise CheckpointError(f"checkpoint file '{path}' is truncated") from None


def write_manifest(directory: str | os.PathLike) -> Path:
    """Record size and sha256 of every file under ``directory`` (per tensor for safetensors); returns the manifest.

    Call it last, once every file of the checkpoint is complete: the manifest is
    written to a temporary name, flushed and renamed, so it never lists a file
    that was still being written.

    Example:
        >>> write_manifest("outputs/run/.tmp-checkpoint-10/checkpoint-10")  # doctest: +SKIP
    """
    directory = Path(directory)
    honour_umask(directory)  # safetensors 0.8 writes 0600; the rest of the directory is 0666 less the umask
    files = {}
    for path in _files(directory):
        # A file this process just wrote was hashed as it was written (the same digests, without reading
        # 89 GiB back); any other file, or one changed since, is read.
        files[path.relative_to(directory).as_posix()] = _entry(path)
    target = directory / MANIFEST
    tmp = directory / f".{MANIFEST}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"format": MANIFEST_FORMAT, "files": files}, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, target)
    return target


def content_hash(directory: str | os.PathLike) -> str | None:
    """sha256 of ``directory``'s manifest, which names every file's sha256: one hash for the whole content
    (None without a manifest).

    Example:
        >>> import tempfile
        >>> content_hash(tempfile.mkdtemp()) is None
        True
    """
    path = Path(directory) / MANIFEST
    try:  # the path an export records may hold anything now: a FIFO there is refused unopened
        return hashlib.sha256(read_bytes(path, f"checkpoint file '{path}'", MAX_RECORD_BYTES, CheckpointError)).hexdigest()
    except CheckpointError:
        return None


def verify_if_neutrain(directory: str | os.PathLike) -> bool:
    """Verify ``directory`` as a checkpoint (:func:`verify_checkpoint`) when neutrain wrote it (it has a manifest, or
    a file only a neutrain that writes one writes); returns whether it did. A foreign model is left to its loader.

    Why: a ``model.base_model`` (or a LoRA base) that is a neutrain checkpoint or export with a flipped byte was
    trained on: only the commands that load a checkpoint as such checked it.
    """
    directory = Path(directory)
    if not directory.is_dir() or not ((directory / MANIFEST).is_file() or written_with_manifest(directory)):
        return False
    verify_checkpoint(directory)
    return True


def written_with_manifest(directory: str | os.PathLike) -> str | None:
    """Why ``directory`` must have a manifest (a file only a neutrain that writes one writes), else None.

    Example:
        >>> import tempfile
        >>> written_with_manifest(tempfile.mkdtemp()) is None  # a foreign model, or an older neutrain's
        True
    """
    directory = Path(directory)
    for name in WRITTEN_WITH_MANIFEST:
        if (directory / name).is_file():
            return f"it holds {name}"
    state_path = directory / "trainer_state.json"
    try:  # NaN allowed: a skipped step's loss is logged as NaN in its log history
        state = read_json_object(state_path, f"checkpoint file '{state_path}'", CheckpointError, MAX_RECORD_BYTES,
                                 allow_nan=True)
        marked = MANIFEST_MARK in state.get("stateful_callbacks", {})
    except (CheckpointError, TypeError):
        marked = False
    return f"its trainer_state.json records {MANIFEST_MARK}" if marked else None


def _not_there(file: Path) -> str:
    """What stands at ``file``, which is not a regular file: missing, or its kind (a FIFO, a directory, ...).
    Why: a FIFO or a directory in a listed file's place was reported as missing, sending the user to look for a
    file that is there."""
    try:
        return f"is {kind_word(os.stat(file).st_mode)}, not a regular file"
    except OSError:
        return "is missing"


def _check_manifest(directory: Path, may_be_missing: Iterable[str] = ()) -> None:
    path = directory / MANIFEST
    if not os.path.lexists(path):  # a FIFO or a directory in its place is read, and refused, below
        expected = written_with_manifest(directory)
        if expected is not None:
            raise CheckpointError(f"checkpoint '{directory}' has no {MANIFEST}, yet it was written by a neutrain that "
                                  f"writes one ({expected}): the manifest was deleted or lost, so no file of it can be "
                                  f"checked; use another checkpoint-N (or export) of the run")
        logger.warning("checkpoint '%s' has no %s (written before neutrain checksummed its checkpoints, or not by "
                       "neutrain): its files are not checksummed", directory, MANIFEST)
        return
    manifest = read_json_object(path, f"checkpoint file '{path}'", CheckpointError, MAX_RECORD_BYTES)
    files = manifest.get("files") if manifest.get("format") == MANIFEST_FORMAT else None
    if not isinstance(files, dict) or not all(isinstance(entry, dict) for entry in files.values()):
        raise CheckpointError(f"checkpoint file '{path}' is not a neutrain manifest (corrupt or replaced)")
    # Every file is checked, not only those listed: a file the manifest does not name (added since, or its
    # entry deleted to hide a changed byte) would otherwise load unchecked.
    listed = {PurePosixPath(rel).as_posix() for rel in files}
    unlisted = [p for p in _files(directory) if p.relative_to(directory).as_posix() not in listed]
    if unlisted:
        more = f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""
        raise CheckpointError(f"checkpoint file '{unlisted[0]}'{more} is not listed in {MANIFEST}: it was added (or its "
                              f"entry removed) after the checkpoint was written, so it cannot be checked; refused")
    for rel, expected in sorted(files.items()):
        file = inside(directory, rel)  # '../../etc/passwd' would make the check a size and hash oracle
        if not file.is_file():
            if rel in may_be_missing and not os.path.lexists(file):  # a FIFO there is not "missing"
                continue
            raise CheckpointError(f"checkpoint file '{file}' {_not_there(file)} (listed in {MANIFEST})")
        size = file.stat().st_size
        if size != expected.get("size"):
            raise CheckpointError(f"checkpoint file '{file}' has {size} bytes, {expected.get('size')} when it was "
                                  f"written (truncated or changed)")
        _check_file_digests(file, expected)


def _check_file_digests(file: Path, expected: dict) -> None:
    """Raise naming the file (and the tensor) where ``file``'s bytes differ from its manifest entry.

    A safetensors file whose entry has a header digest and whose tensors tile its data is checked by its header's
    digest and its tensors' (on threads, no serial pass over the file); any other file by its whole sha256."""
    tiled = _tiled_spans(file) if file.suffix == ".safetensors" and isinstance(expected.get(HEADER_DIGEST), str) \
        and isinstance(expected.get("tensors"), dict) else None
    if tiled is not None:
        start, spans = tiled
        header_ok = _header_digest(file, start) == expected[HEADER_DIGEST]
        tensors = _tensor_digests(file, spans) if header_ok else {}
        if header_ok and tensors == expected["tensors"]:
            return
    else:
        digest, tensors = _digests(file)
        if digest == expected.get("sha256"):
            return
        header_ok = True
    where = _where_changed(expected, tensors, header_ok)
    raise CheckpointError(f"checkpoint file '{file}' fails its sha256 checksum{where}: a byte changed after it "
                          f"was written")


def _where_changed(expected: dict, tensors: dict[str, str], header_ok: bool) -> str:
    """Where a file that failed its checksum changed, as the tail of the message: its header, its first changed
    tensor (and how many more), or nothing where its entry names no tensors."""
    if not header_ok:
        return " in its header"
    changed = [name for name, sha in expected.get("tensors", {}).items() if tensors.get(name) != sha]
    if changed:
        return f" in tensor '{changed[0]}'" + (f" (and {len(changed) - 1} more)" if len(changed) > 1 else "")
    # Every tensor matches, yet the file does not: the bytes outside them (the header) changed.
    return " in its header" if expected.get("tensors") else ""


def _numpy_safe_globals() -> list:
    """numpy types in the Trainer's ``rng_state*.pth`` (the same allowlist ``transformers`` loads them with)."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def check_torch_file(path: Path) -> None:
    """Refuse a torch file that ``torch.load(weights_only=True)`` rejects (code, custom objects) or cannot read."""
    import torch

    def load(mmap: bool):
        with torch.serialization.safe_globals(_numpy_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)

    try:
        try:
            load(mmap=True)  # tensors stay on disk: only the pickled structure is read
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            load(mmap=False)  # legacy (non-zip) format
    except pickle.UnpicklingError as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "Weights only load failed" in reason or "Unsupported global" in str(exc):
            raise CheckpointError(f"checkpoint file '{path}' refused: it holds objects other than tensors and "
                                  f"containers, and loading it would run code from the file") from None
        raise CheckpointError(f"checkpoint file '{path}' is corrupt or truncated ({reason})") from None
    except Exception as exc:  # truncated zip, bad magic, ...: torch raises many types
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint file '{path}' is corrupt or truncated ({type(exc).__name__}: {reason})") from None


def check_file(path: Path) -> None:
    """Refuse ``path`` unless it is safetensors, JSON, a weights-only torch file or UTF-8 text (see module doc)."""
    suffix = path.suffix
    if suffix == ".safetensors":
        safetensors_header(path)
    elif suffix == ".json":
        # Bounded and decoded by the one reader, then only parsed: any JSON value is valid here (NaN too: a skipped
        # step's loss in trainer_state.json), and a tokenizer.json of a large vocabulary is tens of MiB.
        text = read_text(path, f"checkpoint file '{path}'", MAX_FOLDER_TEXT_BYTES, CheckpointError)
        try:
            json.loads(text)
        except ValueError:
            raise CheckpointError(f"checkpoint file '{path}' is not valid JSON (truncated or corrupt)") from None
    elif path.name == "training_args.bin":
        # Older neutrain (and the Trainer) pickled the TrainingArguments object here; nothing reads it.
        raise CheckpointError(f"checkpoint file '{path}' refused: it is a pickle, which neutrain never loads; delete "
                              f"it to use this checkpoint (neutrain now writes training_args.json)")
    elif suffix in TORCH_SUFFIXES:
        check_torch_file(path)
    elif suffix in DATA_SUFFIXES:
        pass
    elif suffix in TEXT_SUFFIXES or path.name in TEXT_NAMES:
        try:
            read_bytes(path, f"checkpoint file '{path}'", MAX_FOLDER_TEXT_BYTES, CheckpointError).decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"checkpoint file '{path}' is not UTF-8 text") from None
    else:
        raise CheckpointError(f"checkpoint file '{path}' refused: neutrain loads only safetensors, JSON and "
                              f"weights-only torch files (.pt/.pth/.bin), and cannot vouch for this one")


def verify_checkpoint(directory: str | os.PathLike, required: Iterable[str] = (), may_be_missing: Iterable[str] = ()) -> None:
    """Check a checkpoint before anything in it is loaded; raise :class:`CheckpointError` naming the file.

    Args:
        directory: the checkpoint (or export) directory.
        required: file names that must exist (e.g. ``trainer_state.json`` for a resume).
        may_be_missing: file names the manifest lists that the caller chose to do without.

    Example:
        >>> verify_checkpoint("outputs/run/export")  # doctest: +SKIP
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint '{directory}' does not exist or is not a directory")
    check_tree(directory)  # before any file is read: a symlink must not lead the checks outside
    check_indexes(directory)  # a sharded index must not name a file outside the checkpoint either
    for name in required:
        if not (directory / name).is_file():
            raise CheckpointError(f"checkpoint file '{directory / name}' {_not_there(directory / name)}")
    _check_manifest(directory, tuple(may_be_missing))
    for path in _files(directory):
        check_file(path)


# What neutrain writes in the folders of a run that hold no manifest: the tokenizer, evaluations, distillation logs,
# and a checkpoint written before checkpoints carried one.
UNLISTED_OUTPUTS = re.compile(
    r"tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|chat_template\.jinja|vocab\.json|merges\.txt|"
    r"added_tokens\.json|tokenizer\.model|eval_results\.json|metrics\.jsonl|training_curves\.png|summary\.json|"
    r"writer\.json|trainer_state\.json|training_args\.(bin|json)|optimizer\.pt|scheduler\.pt|rng_state(_\d+)?\.pth|"
    r"(model|adapter_model)(-\d+-of-\d+)?\.safetensors(\.index\.json)?|(generation_|adapter_)?config\.json|"
    r"neutrain_\w+\.json|README\.md|long_context_\w+\.json")


def _listed(directory: Path) -> set[str] | None:
    """The files ``directory``'s manifest lists (and the manifest), or None where it has no readable one."""
    try:
        manifest = read_json_object(directory / MANIFEST, f"checkpoint file '{directory / MANIFEST}'",
                                    CheckpointError, MAX_RECORD_BYTES)
    except CheckpointError:
        return None
    files = manifest.get("files") if manifest.get("format") == MANIFEST_FORMAT else None
    return {*files, MANIFEST} if isinstance(files, dict) else None


def foreign_files(directory: str | os.PathLike) -> list[Path]:
    """The files under ``directory`` (a folder a run wrote) that neutrain did not write: in a model folder, those
    its manifest does not list; elsewhere, names neutrain does not write there (:data:`UNLISTED_OUTPUTS`).

    Why: an overwrite, the checkpoint rotation and an ``export --overwrite`` deleted whole folders, and with
    them the notes a user had put inside; a folder holding such a file must be kept or refused, not deleted.

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> _ = (root / "tokenizer.json").write_text("{}"), (root / "notes.txt").write_text("mine")
        >>> [p.name for p in foreign_files(root)]
        ['notes.txt']
    """
    directory = Path(directory)
    if directory.is_symlink() or not directory.is_dir():
        return []
    found: list[Path] = []
    for folder, subfolders, names in os.walk(directory):
        folder_path = Path(folder)
        listed = _listed(folder_path) if MANIFEST in names else None
        if listed is not None:  # the manifest speaks for its whole tree
            found.extend(p for p in sorted(folder_path.rglob("*"))
                         if not p.is_dir() and p.relative_to(folder_path).as_posix() not in listed
                         and not p.name.startswith(f".{MANIFEST}.tmp"))
            subfolders.clear()
            continue
        found.extend(folder_path / n for n in sorted(names) if not UNLISTED_OUTPUTS.fullmatch(n))
    return found
