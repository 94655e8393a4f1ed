"""Reading raw examples from local files, offline, through ``datasets``.

Supported: json, jsonl, csv, parquet and plain text files (or a directory of
them), plus the built-in ``python-stdlib`` corpus: the Python standard
library's own source files, which every machine with Python has. That corpus
is how the default recipe trains on real text with no download.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import sysconfig
from pathlib import Path
from typing import Any

from neutrain.compat.file_modes import fsync_dir
from neutrain.data.bounds import check_bounds
from neutrain.errors import DataError
from neutrain.files import check_kind

_EXT_TO_TYPE = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text", ".text": "text", ".md": "text"}


@contextlib.contextmanager
def quiet_datasets():
    """No ``datasets`` progress bars inside the block ("Generating train split", "Filter").

    Why: they carry no label a user can place, and the steps they show take well under a
    second; neutrain's own tokenising bar names the source instead.
    """
    import datasets  # lazy: callers already imported it; `import neutrain.data` stays light

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def _ds_type(path: Path, declared: str | None) -> str:
    if declared:
        return "json" if declared == "jsonl" else declared
    if path.is_dir():  # its data files' type, however the folder itself is named
        kinds = {_EXT_TO_TYPE[Path(f).suffix.lower()] for f in _files(path)}
        if len(kinds) > 1:
            raise DataError(f"{path}: directory holds files of several types ({', '.join(sorted(kinds))}); give each "
                            "type its own dataset entry, or set ds_type")
        return kinds.pop()
    kind = _EXT_TO_TYPE.get(path.suffix.lower())
    if kind is None:
        raise DataError(f"{path}: cannot tell the file type from the extension '{path.suffix}' (expected one of "
                        f"{', '.join(sorted(_EXT_TO_TYPE))}); set ds_type")
    return kind


def _hidden(relative: Path) -> bool:
    """Whether a path inside a data folder is hidden by its name or a folder's: ``.``, or ``__`` (``__MACOSX``)."""
    return any(part.startswith((".", "__")) for part in relative.parts)


@functools.lru_cache(maxsize=64)  # once per folder and contents: the folder is listed by several steps of a load
def _say_hidden(folder: str, hidden: tuple[str, ...]) -> None:
    logging.getLogger("neutrain").warning(
        "data folder '%s': %d hidden file(s) left out (%s%s); a name or folder starting with '.' or '__' is not data",
        folder, len(hidden), ", ".join(hidden[:3]), ", ..." if len(hidden) > 3 else "")


def _files(path: Path) -> list[str]:
    """The data files a dataset entry names: the file itself, or a folder's data files at any depth, hidden ones left
    out (as ``datasets`` leaves them out of a folder) with a warning naming them.

    Why: a folder's ``.ipynb_checkpoints/train-checkpoint.jsonl`` (Jupyter's copy of a file beside it) was trained on
    as well, every row twice, and macOS's ``._train.jsonl`` (its binary resource fork, which Finder does not show)
    failed the run as not UTF-8, naming a file the user never saw.
    """
    if path.is_dir():
        found = [f for f in sorted(path.rglob("*")) if f.suffix.lower() in _EXT_TO_TYPE and not f.is_dir()]
        named = [f for f in found if not _hidden(f.relative_to(path))]
        if len(named) < len(found):
            _say_hidden(str(path), tuple(str(f.relative_to(path)) for f in found if _hidden(f.relative_to(path))))
        for f in named:  # a FIFO or device named like data was skipped in silence (the rows it stood for lost)
            check_kind(f, f"data file '{f}' (in the directory '{path}')", DataError)
        files = [str(f) for f in named]
        if not files:
            hidden = f" other than hidden ones ({len(found)}, left out)" if found else ""
            raise DataError(f"{path}: directory holds no {', '.join(sorted(_EXT_TO_TYPE))} files{hidden}")
        return files
    return [str(path)]


def _locate_bad_json_row(files: list[str]) -> str | None:
    """Find the first unparsable line of a jsonl file, to name it in the error."""
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            first = fh.read(1)
            if first == "[":  # a JSON array file: report it whole
                fh.seek(0)
                try:
                    json.load(fh)
                except json.JSONDecodeError as exc:
                    return f"{f}: invalid JSON at line {exc.lineno} ({exc.msg})"
                continue
            fh.seek(0)
            for i, line in enumerate(fh):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    return f"{f}: row {i} (line {i + 1}) is not valid JSON ({exc.msg})"
                if not isinstance(row, dict):
                    return f"{f}: row {i} (line {i + 1}) is a {type(row).__name__}, expected a JSON object"
    return None


def load_rows(entry: dict[str, Any], streaming: bool = False, cache_dir: str | None = None):
    """Load one dataset entry of a recipe as a ``datasets`` (Iterable)Dataset.

    Args:
        entry: A validated ``data.datasets[i]`` mapping.
        streaming: Return an ``IterableDataset`` that reads lazily.
        cache_dir: The run's cache: generated corpora (python-stdlib) and ``datasets``' own cache
            (:func:`datasets_cache`) are written there; None: a private temporary cache, removed at exit.

    Raises:
        DataError: naming the file and, where possible, the row.
    """
    import datasets

    # datasets logs each failed parse at ERROR level (for csv, twice); the DataError below is the one line instead.
    for kind in ("json", "csv", "text", "parquet"):
        logging.getLogger(f"datasets.packaged_modules.{kind}.{kind}").setLevel(logging.CRITICAL)
    cache_dir = cache_dir or private_cache()
    if entry["path"] == "python-stdlib":
        path = Path(entry_files(entry, cache_dir)[0])
        ds_type = "json"
    else:
        path = Path(entry["path"])
        _check_regular(path)  # before the extension is looked at: a FIFO or device is not blamed on it
        ds_type = _ds_type(path, entry.get("ds_type"))
    files = _files(path)
    if entry["path"] != "python-stdlib":  # hostile shapes are refused before a native parser can crash on them
        check_bounds(files, ds_type)
    kwargs: dict[str, Any] = {"cache_dir": datasets_cache(cache_dir)}
    if ds_type == "text":
        kwargs["sample_by"] = "document"  # one example per file, as pretraining corpora expect
    try:
        try:
            with quiet_datasets():
                ds = datasets.load_dataset(ds_type, data_files=files, split="train", streaming=streaming, **kwargs)
        except Exception as first:
            if not _discard_cache(kwargs["cache_dir"], first):
                raise
            with quiet_datasets():  # once more, from the files alone
                ds = datasets.load_dataset(ds_type, data_files=files, split="train", streaming=streaming, **kwargs)
    except Exception as exc:  # datasets raises many types; name the file either way
        unwritable = _cache_not_writable(exc, files)
        if unwritable is not None:  # the environment's fault, not the data's: exit 1 (neutrain.cli.environment)
            raise unwritable from None
        raise _read_error(files, ds_type, exc) from None
    if not streaming:
        return ds
    # A stream reads its files only while training (or training a tokenizer): wrap it so that a bad row
    # met there is reported like one met here, naming the file and row, not as a pyarrow traceback.
    return stream_from(_guarded_stream, cache_dir, features=ds.features,
                       gen_kwargs={"files": files, "ds_type": ds_type, "kwargs": kwargs})


def _discard_cache(cache: str, exc: Exception) -> bool:
    """Empty ``datasets``' cache of this run after a failed load, so the caller can build it again from the files;
    False when there was nothing to discard (the failure is the data's).

    Why: the cache is derived, written without fsync by ``datasets``, and lives in the run's folder. After a
    power cut its files can be cut short, and the next resume then failed on a JSON error naming the run's
    corpus, though the corpus itself was whole.
    """
    import shutil

    path = Path(cache)
    if not path.is_dir() or not any(path.iterdir()):
        return False
    logging.getLogger("neutrain").warning("the data cache %s could not be read (%s): built again from the files",
                                          path, type(exc).__name__)
    shutil.rmtree(path, ignore_errors=True)
    return True


def entry_files(entry: dict[str, Any], cache_dir: str | None = None) -> list[str]:
    """The files one ``data.datasets`` entry reads (``python-stdlib``: its corpus in ``cache_dir``, written if needed)."""
    if entry["path"] == "python-stdlib":
        return [python_stdlib_corpus(cache_dir or private_cache(), max_files=entry.get("max_files"))]
    return _files(Path(entry["path"]))


def file_fingerprints(datasets: list[dict[str, Any]], cache_dir: str | None = None) -> dict[str, str]:
    """``{file: "<size> bytes, sha256 <hex>"}`` of every file the recipe's datasets read, in read order.

    Why: which rows a resumed run trains next depends on the data as much as on the recipe; an edited
    file or a corpus cut short resumed without a word and trained on other rows than the run it continued.
    Hashed in full (the files are read to tokenise them anyway).

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "d.jsonl")
        >>> _ = open(path, "w").write('{"text": "hi"}\\n')
        >>> file_fingerprints([{"path": path}])[path][:9]
        '15 bytes,'
    """
    prints = {}
    for entry in datasets:
        for name in entry_files(entry, cache_dir):
            digest = hashlib.sha256()
            with open(name, "rb") as fh:
                while block := fh.read(1 << 24):
                    digest.update(block)
            # The corpus is written into each run's own cache: named by what it is, not where it lies.
            key = f"python-stdlib/{os.path.basename(name)}" if entry["path"] == "python-stdlib" else name
            prints[key] = f"{os.path.getsize(name)} bytes, sha256 {digest.hexdigest()}"
    return prints


def datasets_cache(cache_dir: str | os.PathLike) -> str:
    """Where ``datasets`` builds and reads its Arrow files for a run whose cache is ``cache_dir``.

    Why: under ``datasets``' user-wide cache (``~/.cache/huggingface/datasets``) two runs over the same
    corpus at once shared one build directory, keyed by the files alone, and one read the tables (and the
    tokenised and shuffled copies) the other was writing; a resumed run then trained on rows that differed
    from the uninterrupted run's. Under each run's own ``.cache`` no other process writes them.
    """
    return os.path.join(cache_dir, "datasets")


def stream_from(generator, cache_dir: str | os.PathLike, features=None, gen_kwargs: dict | None = None):
    """``datasets.IterableDataset.from_generator``, its builder's lock file under :func:`datasets_cache` (the
    public call takes no cache directory, and locks in the user-wide one)."""
    from datasets.io.generator import GeneratorDatasetInputStream

    return GeneratorDatasetInputStream(generator=generator, features=features, gen_kwargs=gen_kwargs, streaming=True,
                                       cache_dir=datasets_cache(cache_dir)).read()


@functools.lru_cache(maxsize=1)
def private_cache() -> str:
    """A cache of this process's own, for data built with no run directory to hold it; removed at exit."""
    import atexit
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix="neutrain-data-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _check_regular(path: Path) -> None:
    """Refuse a data path that is neither a regular file nor a directory (a FIFO would block, /dev/zero never ends)."""
    if os.path.lexists(path):  # missing: the recipe check named it already, or the reader will
        check_kind(path, f"data file '{path}'", DataError, want="any")


# Where ``datasets`` writes its cache, most specific first: the variable a user would change.
_CACHE_VARIABLES = ("HF_DATASETS_CACHE", "HF_HOME", "XDG_CACHE_HOME", "HOME")
_UNWRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT}


def _cache_not_writable(exc: BaseException, files: list[str]) -> OSError | None:
    """An ``OSError`` naming the variable behind an unwritable datasets cache, if that is what ``exc`` is.

    Why: a read-only ``HOME`` or ``HF_HOME`` used to be reported as a data error (exit 2) although the
    data was fine; the fix is in the environment (exit 1), so say which variable to change.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _UNWRITABLE and exc.filename and str(exc.filename) not in files:
            target = os.path.abspath(str(exc.filename))
            named = [v for v in _CACHE_VARIABLES if os.environ.get(v)]
            under = [v for v in named if target.startswith(os.path.abspath(os.environ[v]).rstrip(os.sep) + os.sep)]
            var = (under or named or ["HOME"])[0]
            error = OSError(exc.errno, exc.strerror or os.strerror(exc.errno), exc.filename)
            error.add_note(f"{var}={os.environ.get(var, '')} is not writable, and the datasets cache is written under "
                           f"it; point {var} (or HF_DATASETS_CACHE) at a writable directory")
            return error
        exc = exc.__cause__ or exc.__context__
    return None


def _read_error(files: list[str], ds_type: str, exc: BaseException) -> DataError:
    """The one-line error for a data file that ``datasets`` could not read."""
    if all(_is_blank(f) for f in files):
        return DataError(f"{', '.join(files)}: no rows (it is empty)")
    detail = _locate_bad_json_row(files) if ds_type == "json" else None
    while type(exc).__name__ == "DatasetGenerationError" and (exc.__cause__ or exc.__context__) is not None:
        exc = exc.__cause__ or exc.__context__  # the parser's own error says where (pandas: "at row 2")
    first_line = str(exc).splitlines()[0] if str(exc) else ""
    return DataError(detail or f"{', '.join(files)}: could not be read as {ds_type} ({type(exc).__name__}: {first_line})")


def _is_blank(path: str) -> bool:
    """True when a file holds nothing but whitespace (read in blocks: data files can be large)."""
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            if block.strip():
                return False
    return True


def _guarded_stream(files: list[str], ds_type: str, kwargs: dict[str, Any]):
    """Yield the rows of ``files``, turning a read failure into a :class:`DataError`."""
    import datasets

    rows = iter(datasets.load_dataset(ds_type, data_files=files, split="train", streaming=True, **kwargs))
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as exc:  # pyarrow and datasets errors alike
            raise _read_error(files, ds_type, exc) from None
        yield row


@functools.lru_cache(maxsize=4)
def _stdlib_sources(root: str) -> tuple[Path, ...]:
    """The standard library's source files the corpus draws from (listed once per process: a walk of the whole
    library takes a quarter of a second, and each run asks for the corpus more than once)."""
    # encodings/ is mostly generated charmap tables (cp1252.py, mac_roman.py...): data, not the Python
    # a model should learn to write.
    skip = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__", "ensurepip", "pydoc_data",
            "encodings"}
    base = Path(root)
    return tuple(sorted(
        p for p in base.rglob("*.py")
        if not (set(p.relative_to(base).parts[:-1]) & skip) and 2_000 <= p.stat().st_size <= 200_000
    ))


def python_stdlib_corpus(cache_dir: str, max_files: int | None = None) -> str:
    """Write the standard library's ``.py`` sources to ``<cache_dir>/python-stdlib.jsonl``.

    Each row is ``{"text": source, "file": relative path, "heldout": bool}``. The
    held-out flag comes from a hash of the path (about 5% of files), so the split
    is the same on every machine and every run.

    Example:
        >>> path = python_stdlib_corpus("/tmp/neutrain-cache", max_files=50)
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = list(_stdlib_sources(str(root)))

    def is_heldout(f: Path) -> bool:
        return int(hashlib.md5(str(f.relative_to(root)).encode()).hexdigest(), 16) % 20 == 0

    if max_files:
        # Spread the pick over the whole library, and keep about 5% (at least one) held-out file.
        held = [f for f in files if is_heldout(f)]
        train = [f for f in files if not is_heldout(f)]
        n_held = max(1, round(max_files * len(held) / len(files)))
        n_train = max(1, max_files - n_held)
        files = sorted(train[:: max(1, len(train) // n_train)][:n_train] + held[:: max(1, len(held) // n_held)][:n_held])
    digest = hashlib.sha1("\n".join(str(f.relative_to(root)) for f in files).encode()).hexdigest()[:12]
    out = Path(cache_dir) / f"python-stdlib-{digest}.jsonl"
    if out.exists():
        if _whole_rows(out) == len(files):
            return str(out)
        # Cut short (a power cut before it was synced, a full disk, a hand edit): a shorter corpus would train
        # on other rows than the run that wrote it, so it is written again.
        logging.getLogger("neutrain").warning("data cache %s holds %d of its %d rows: rebuilt", out, _whole_rows(out),
                                              len(files))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        for f in files:
            rel = str(f.relative_to(root))
            text = f.read_text(encoding="utf-8", errors="replace")
            fh.write(json.dumps({"text": text, "file": rel, "heldout": is_heldout(f)}) + "\n")
        fh.flush()
        os.fsync(fh.fileno())  # on the disk before it is renamed into place
    os.replace(tmp, out)
    fsync_dir(out.parent)
    return str(out)


def _whole_rows(path: Path) -> int:
    """Rows of a JSON-lines file that end in a newline and parse (one written whole)."""
    rows = 0
    with open(path, "rb") as fh:
        for line in fh:
            if not line.endswith(b"\n"):
                break
            try:
                json.loads(line)
            except ValueError:
                break
            rows += 1
    return rows
