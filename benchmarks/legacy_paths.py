"""Where the flat ``benchmarks/`` layout's paths live now, and a rewrite of the text that names them.

``benchmarks/`` was flat (scripts, ``notes_*.md``, ``diag/``, ``results/<name>.json``); it is now one folder a
topic (``benchmarks/<topic>/``: scripts, device script, ``NOTES.md``, ``results.jsonl``). Text written against the
flat layout (docstrings, docs, a branch merged later) is brought up to date with::

    python benchmarks/legacy_paths.py neutrain docs README.md     # rewrites the files in place, lists them
    python benchmarks/legacy_paths.py --check neutrain            # lists what still names a flat path

A record path becomes ``benchmarks/<topic>/results.jsonl#<name>`` (the row's name after the ``#``). Once nothing
names a ``benchmarks/notes_*.md`` any more, the one-line pointers left at those paths can go (a rewrite removes
them then).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
TOPICS = ("attention", "cards", "codec", "decode", "kv", "memory", "multi_gpu", "offload", "training")
NOTES = {"attention": "attention", "cards": "cards", "codec": "codec", "kv_eval": "kv", "multi_gpu": "multi_gpu",
         "offload": "offload", "speculative": "decode", "train_memory": "memory", "determinism": "training",
         "clip_convergence": "training", "cpu_dtype": "training", "finetune_lr": "training"}
FILES = {"notes_finetune_lr.json": "training/results.jsonl#finetune_lr_cpu",
         "notes_recipe_learning.json": "training/recipe_learning.json",
         "results/archive/README.md": "README.md#records", "results/archive/": "README.md#records",
         "results/archive": "README.md#records"}


def scripts() -> dict[str, str]:
    """``{old path under benchmarks/: new path}`` for every script now in a topic folder."""
    moved = {}
    for topic in TOPICS:
        for path in sorted((BENCH / topic).glob("*")):
            if path.suffix in (".py", ".sh"):
                moved[path.name] = f"{topic}/{path.name}"
                moved[f"diag/{path.name}"] = f"{topic}/{path.name}"
    return moved


def _record(rel: str) -> str:
    """``results/...`` -> the table (and row) that holds it."""
    from benchmarks.records import _strip_commit, topic_of

    name = Path(rel).name
    if name.endswith(".xml") or name.startswith("gpu_tests"):
        return "gpu_tests.jsonl"
    stem = name.split(".")[0]
    for part in [stem, *reversed(Path(rel).parts[:-1])]:
        try:
            topic = topic_of(_strip_commit(part))
        except KeyError:
            continue
        if rel.startswith("archive/") or not name.endswith(".json"):
            return f"{topic}/results.jsonl" if name.endswith(".json") or "." not in name else f"{topic}/logs.jsonl"
        return f"{topic}/results.jsonl#{stem}"
    return "README.md#records"


PATH = re.compile(r"benchmarks/((?:diag/|results/)?[\w./-]*[\w/])")


def rewrite(text: str) -> str:
    moved = scripts()

    def new(m: re.Match) -> str:
        rel = m.group(1)
        if rel in FILES:
            return "benchmarks/" + FILES[rel]
        if rel in moved:
            return "benchmarks/" + moved[rel]
        note = re.fullmatch(r"notes_(\w+)\.md", rel)
        if note and note.group(1) in NOTES:
            return f"benchmarks/{NOTES[note.group(1)]}/NOTES.md"
        if rel.startswith("results/"):
            inner = rel[len("results/"):]
            if inner.startswith("profiles/") and inner.count("/") == 1 and inner.endswith(".json"):
                inner = inner[len("profiles/"):]
            if inner in ("", "profiles", "profiles/"):
                return "benchmarks/<topic>/results.jsonl"
            if inner.startswith("profiles/") and not inner.endswith(".json"):
                from benchmarks.records import topic_of
                parts = Path(inner).parts
                try:
                    return f"benchmarks/{topic_of(parts[1] if len(parts) > 2 else parts[-1])}/{inner}"
                except KeyError:
                    return m.group(0)
            return "benchmarks/" + _record(inner)
        return m.group(0)

    return PATH.sub(new, text)


def stale(text: str) -> list[str]:
    return sorted({m.group(0) for m in PATH.finditer(text) if rewrite(m.group(0)) != m.group(0)})


def pointers_left() -> list[Path]:
    return sorted(BENCH.glob("notes_*.md"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", type=Path)
    p.add_argument("--check", action="store_true", help="list the flat paths named, change nothing")
    args = p.parse_args(argv)
    files = [f for path in args.paths for f in ([path] if path.is_file() else sorted(path.rglob("*")))
             if f.is_file() and f.suffix in (".py", ".md", ".sh", ".json", ".yaml", ".txt", ".toml")]
    found = 0
    for f in files:
        text = f.read_text()
        if args.check:
            for old in stale(text):
                print(f"{f}: {old}")
                found += 1
        elif (new := rewrite(text)) != text:
            f.write_text(new)
            print(f"rewrote {f}")
    if not args.check:
        cited = "".join(f.read_text() for f in (ROOT / "neutrain").rglob("*.py"))
        for pointer in pointers_left():
            if f"benchmarks/{pointer.name}" not in cited:
                pointer.unlink()
                print(f"removed {pointer} (nothing in neutrain/ cites it)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
