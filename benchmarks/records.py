"""The benchmark records: one table a topic, ``benchmarks/<topic>/results.jsonl``, one record a line.

A record is what :func:`benchmarks._common.write_result` assembles (``name``, ``git_commit``, ``git_dirty``,
``device``, ``versions``, ``date``, ``targets``, ``settings``, ``results``) plus three keys of the table's own:

- ``current``: true for the one row of a name that the README's tables and the tests read. Appending a
  record of a name makes it current and every earlier row of that name not current, so a table keeps its
  history (the commit is a column) and the newest run of a name is the one read.
- ``source``: the file the row came from when it was folded in (``results/archive/attention_dcf57b4.json``).
- ``archived``: why a row that was never current was set aside (from ``results/archive/README.md``).

The GPU test suite's junit files become rows of ``benchmarks/gpu_tests.jsonl`` (suite name, test counts, each
test's outcome, the commit from its properties or its file name); text logs become rows of the topic's
``logs.jsonl``; binary profiles (``.ncu-rep``, traces) move to ``benchmarks/<topic>/profiles/``.

Device runs leave ``<name>.json`` files in ``$OUT`` (or at the old flat paths under ``results/``);
``add`` and ``migrate`` fold them in, skipping any row already present (same name, commit and content)::

    python benchmarks/records.py migrate              # every legacy file under benchmarks/results/, then removes them
    python benchmarks/records.py add $OUT/*.json      # records a device run brought back, as current rows
    python benchmarks/records.py current attention    # the current row of a name, as JSON
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import shutil
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Iterable

BENCH = Path(__file__).resolve().parent
LEGACY = BENCH / "results"
GPU_TESTS = BENCH / "gpu_tests.jsonl"

# A record's name -> its topic, by the longest matching prefix: the names the benchmarks write today.
TOPIC_PREFIXES = {
    "attention": "attention", "sage": "attention", "gluon_sage": "attention", "ncu_": "attention",
    "cards": "cards",
    "codec": "codec",
    "engine_decode": "decode", "speculative": "decode", "inference": "decode", "zgemv": "decode",
    "decode_profile": "decode", "decode_h200": "decode", "generate": "decode",
    "kv_": "kv", "kv_eval": "kv", "minicache": "kv", "shadowkv": "kv",
    "train_memory": "memory", "train_70b": "memory", "step_anatomy": "memory", "step_timeline": "memory",
    "step_products": "memory", "host_costs": "memory", "training_runs": "memory", "70b": "memory",
    "llama3_8b_recipe": "training",
    "multi_gpu": "multi_gpu", "zero3_ablation": "multi_gpu",
    "offload": "offload",
    "clip_convergence": "training", "convergence": "training", "cpu_train": "training", "cpu_dtype": "training",
    "determinism": "training", "finetune_lr": "training", "recipe_learning": "training", "first_hour": "training",
    "checkpoint_io": "training",
}
TOPICS = sorted(set(TOPIC_PREFIXES.values()))
ROW_KEYS = ("current", "source", "archived")  # the table's own keys: not part of a record's content
_SHA = re.compile(r"(?<![0-9A-Za-z])[0-9a-f]{7,40}(?![0-9A-Za-z])")


def topic_of(name: str) -> str:
    """The topic whose table holds records of ``name``; raises ``KeyError`` for a name no prefix covers."""
    hits = [p for p in TOPIC_PREFIXES if name.startswith(p)]
    if not hits:
        raise KeyError(f"no topic for record {name!r}: add its prefix to TOPIC_PREFIXES in benchmarks/records.py")
    return TOPIC_PREFIXES[max(hits, key=len)]


def table_path(topic: str) -> Path:
    return BENCH / topic / "results.jsonl"


def read_table(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write_table(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r, default=str, ensure_ascii=False) + "\n" for r in rows))
    tmp.replace(path)


def rows(topic: str | None = None) -> list[dict[str, Any]]:
    """Every row of one topic's table, or of every table."""
    return [r for t in ([topic] if topic else TOPICS) for r in read_table(table_path(t))]


def current(name: str, table: Path | None = None) -> dict[str, Any] | None:
    """The current record of ``name`` (None when it has none), without the table's own keys."""
    try:
        path = table or table_path(topic_of(name))
    except KeyError:
        return None
    hits = [r for r in read_table(path) if r.get("name") == name and r.get("current")]
    return {k: v for k, v in hits[-1].items() if k not in ROW_KEYS} if hits else None


def find(name: str, commit: str, table: Path | None = None) -> dict[str, Any] | None:
    """The newest row of ``name`` measured at ``commit`` (a prefix of it will do), current or not."""
    path = table or table_path(topic_of(name))
    hits = [r for r in read_table(path) if r.get("name") == name and str(r.get("git_commit", "")).startswith(commit)]
    return {k: v for k, v in hits[-1].items() if k not in ROW_KEYS} if hits else None


def content_hash(row: dict[str, Any]) -> str:
    body = {k: v for k, v in row.items() if k not in ROW_KEYS}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


def row_key(row: dict[str, Any]) -> tuple[str, str, str]:
    return str(row.get("name")), str(row.get("git_commit")), content_hash(row)


def append(record: dict[str, Any], *, is_current: bool = True, source: str | None = None,
           archived: str | None = None, table: Path | None = None) -> Path:
    """Append ``record`` to its topic's table (or ``table``) unless the same row is there; return the table.

    A current row demotes the earlier current row of its name; a row already present is left as it is. A run that
    writes its record as it goes (the attention sweep after every length, the fidelity study after every arm)
    names one ``run_id`` in each: its newer record replaces its own earlier row instead of adding history.
    """
    path = table or table_path(topic_of(record["name"]))
    existing = read_table(path)
    key = row_key(record)
    if any(row_key(r) == key for r in existing):
        return path
    row = {k: v for k, v in record.items() if k not in ROW_KEYS}
    row["current"] = is_current
    if source:
        row["source"] = source
    if archived:
        row["archived"] = archived
    if is_current:
        if row.get("run_id"):
            same_run = (row["name"], row["run_id"], row.get("git_commit"))
            existing = [r for r in existing if (r.get("name"), r.get("run_id"), r.get("git_commit")) != same_run]
        for r in existing:
            if r.get("name") == row["name"]:
                r["current"] = False
    _write_table(path, [*existing, row])
    return path


def _commit_in(path: str) -> str | None:
    """The commit a legacy path is named by (``junit_gpu_481fc88.xml``, ``cards_3a280e1/j5.json``), if any."""
    found = [m for part in Path(path).parts for m in _SHA.findall(Path(part).name.split(".")[0])]
    return found[-1] if found else None


def _strip_commit(stem: str) -> str:
    return re.sub(r"_+$", "", _SHA.sub("", stem).replace("__", "_"))


# -- the legacy files -------------------------------------------------------------------------------------


def archive_reasons(readme: Path) -> dict[str, str]:
    """``{listed path: why archived}`` from the archive README's tables (a folder's entry covers its files)."""
    reasons: dict[str, str] = {}
    if not readme.exists():
        return reasons
    for line in readme.read_text().splitlines():
        m = re.match(r"\|\s*`([^`]+)`\s*\|(.*)\|\s*$", line)
        if m:
            cells = [c.strip() for c in m.group(2).split("|")]
            why = cells[0] + (f" (superseded by {cells[1]})" if len(cells) > 1 and cells[1] not in ("", "-") else "")
            reasons[m.group(1).rstrip("/")] = why
    return reasons


def _reason(rel: str, reasons: dict[str, str]) -> str:
    parts = Path(rel).parts
    for n in range(len(parts), 0, -1):
        if "/".join(parts[:n]) in reasons:
            return reasons["/".join(parts[:n])]
    return "kept from results/archive/ (no entry in its README)"


def junit_row(xml: bytes, source: str) -> dict[str, Any]:
    """A junit file as a row: its suites' counts, each test's outcome, and the commit it names."""
    root = ET.fromstring(xml)
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    props = {p.get("name"): p.get("value") for p in root.iter("property")}
    dirty = props.get("git_dirty")
    row: dict[str, Any] = {"name": _strip_commit(Path(source).name.rsplit(".", 1)[0]), "kind": "junit",
                           "git_commit": props.get("git_commit") or _commit_in(source),
                           "git_dirty": None if dirty is None else dirty == "true", "suites": [], "tests": []}
    if row["git_dirty"] is None:
        row["git_dirty_note"] = "the junit file records no git_dirty property"
    for s in suites:
        row["suites"].append({k: s.get(k) for k in ("name", "tests", "failures", "errors", "skipped", "time",
                                                    "timestamp", "hostname")})
        for case in s.iter("testcase"):
            outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
            test = {"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome, "time": case.get("time")}
            detail = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
            if detail is not None and detail.get("message"):
                test["message"] = detail.get("message")[:500]
            row["tests"].append(test)
    return row


def _log_rows(path: Path, rel: str) -> Iterable[dict[str, Any]]:
    """Text logs as rows; a ``.tgz`` of logs gives one row per text member."""
    if path.name.endswith((".tgz", ".tar.gz")):
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                if member.isfile():
                    data = tar.extractfile(member).read()
                    yield {"name": _strip_commit(Path(rel).parent.name or path.stem), "kind": "log",
                           "git_commit": _commit_in(rel), "file": member.name,
                           "text": data.decode("utf-8", "replace")}
        return
    yield {"name": _strip_commit(path.name.rsplit(".", 1)[0]), "kind": "log", "git_commit": _commit_in(rel),
           "file": path.name, "text": path.read_text(errors="replace")}


def _log_topic(rel: str) -> Path:
    for part in reversed(Path(rel).parts):
        try:
            return BENCH / topic_of(_strip_commit(part)) / "logs.jsonl"
        except KeyError:
            continue
    return GPU_TESTS  # gpu_tests*.log: the suite's own log, beside its junit rows


def fold(path: Path, rel: str, *, is_current: bool, reason: str | None) -> str:
    """Fold one legacy file in as rows (or move a binary profile); return what was done, for the log."""
    name = path.name
    if name.endswith(".xml"):
        append(junit_row(path.read_bytes(), rel), is_current=is_current, source=rel, archived=reason, table=GPU_TESTS)
        return "junit row"
    if name.endswith((".log", ".txt", ".tgz")):
        table = _log_topic(rel)
        for row in _log_rows(path, rel):
            append(row, is_current=False, source=rel, table=table)
        return f"log rows in {table.relative_to(BENCH)}"
    if name.endswith(".json"):
        record = json.loads(path.read_text())
        stem = path.stem
        if "archive" in Path(rel).parts and "git_commit" in record:
            # an archived run of a benchmark keeps the name it ran under; parts of a run take their file's
            stem = record.get("name") or stem
        elif "git_commit" not in record:
            folder = _strip_commit(path.parent.name) if path.parent != LEGACY else ""
            stem = f"{folder}_{stem}" if folder and not stem.startswith(folder) else stem
            record = {"git_commit": _commit_in(rel), "git_dirty": None,
                      "git_dirty_note": "a part of a run, kept as it was written (no provenance of its own)",
                      "targets": {}, "targets_note": "a part of a run; the run's record holds the targets",
                      "results": record}
        if record.get("name") not in (None, stem):
            record = {**record, "record_name": record["name"]}
        record = {**record, "name": stem}
        append(record, is_current=is_current, source=rel, archived=reason)
        return "record row"
    # binary profiles (.ncu-rep, traces): files, not rows; they move beside their topic's notes
    dest = BENCH / topic_of(Path(rel).parts[1] if rel.startswith("profiles/") and len(Path(rel).parts) > 2
                            else name) / "profiles" / Path(*Path(rel).parts[1:])
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, dest)
    return f"moved to {dest.relative_to(BENCH)}"


def migrate(legacy: Path = LEGACY, remove: bool = True, log=print) -> int:
    """Fold every file under ``legacy`` (top level and ``profiles/``: current; ``archive/``: not) into the tables.

    Idempotent: a row already present is not added again. With ``remove``, the folded files are deleted
    (the archive's README too, once every file it lists is folded in). Returns the number of files folded.
    """
    if not legacy.exists():
        return 0
    reasons = archive_reasons(legacy / "archive" / "README.md")
    # current records in order of their date, so the newest of a name ends up current
    files = sorted((p for p in legacy.rglob("*") if p.is_file() and p.name != "README.md"),
                   key=lambda p: ("archive" not in p.relative_to(legacy).parts, _date(p), str(p)))
    for path in files:
        rel = str(path.relative_to(legacy))
        archived = rel.startswith("archive/")
        reason = _reason(rel[len("archive/"):], reasons) if archived else None
        done = fold(path, rel, is_current=not archived, reason=reason)
        log(f"{rel}: {done}")
        if remove:
            path.unlink()
    if remove:
        for readme in legacy.rglob("README.md"):
            readme.unlink()
        for d in sorted((p for p in legacy.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            if not any(d.iterdir()):
                d.rmdir()
        if legacy.exists() and not any(legacy.iterdir()):
            legacy.rmdir()
    return len(files)


def _date(path: Path) -> str:
    """When a legacy file was written (a record's ``date``, a junit suite's ``timestamp``), to order them."""
    try:
        if path.suffix == ".json":
            return str(json.loads(path.read_text()).get("date", ""))
        if path.suffix == ".xml":
            return str(next(ET.parse(path).getroot().iter("testsuite")).get("timestamp", ""))
    except (ValueError, AttributeError, ET.ParseError, StopIteration):
        pass
    return ""


def add(paths: Iterable[Path], log=print) -> None:
    """Fold record files a device run brought back (``$OUT/<name>.json``, junit files) in as current rows."""
    for path in paths:
        log(f"{path}: {fold(Path(path), Path(path).name, is_current=True, reason=None)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("migrate", help="fold the legacy benchmarks/results/ into the topic tables and remove the files")
    m.add_argument("--keep", action="store_true", help="leave the legacy files in place")
    m.add_argument("--legacy", type=Path, default=LEGACY)
    a = sub.add_parser("add", help="fold record or junit files (e.g. from $OUT) in as current rows")
    a.add_argument("paths", nargs="+", type=Path)
    c = sub.add_parser("current", help="print the current record of a name")
    c.add_argument("name")
    args = p.parse_args(argv)
    if args.cmd == "migrate":
        print(f"{migrate(args.legacy, remove=not args.keep)} files folded")
    elif args.cmd == "add":
        add(args.paths)
    else:
        record = current(args.name)
        if record is None:
            print(f"no current record named {args.name!r}", file=sys.stderr)
            return 1
        json.dump(record, sys.stdout, indent=2, default=str)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
