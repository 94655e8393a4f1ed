"""Bounds on a data file's lines and JSON nesting, checked before any parser sees the file.

Why: the parsers behind ``datasets`` are native code, and hostile input crashed them without a
word: a JSON row nested 100,000 levels deep killed pyarrow with SIGSEGV (exit 139) or raised
``RecursionError``, and a 207 MB single-line text file aborted the tokenizer's Rust code (exit
134). Neither can be caught once it happens, so every json, jsonl, csv and text file is scanned
first, with plain byte operations:

* a line holds at most :data:`MAX_LINE_BYTES` (16 MiB: a row of 16 MiB of text is about 4M
  tokens, far beyond any ``sequence_len``);
* a JSON row nests at most :data:`MAX_JSON_DEPTH` (100) arrays and objects (chat data nests 3).

A file over either bound is a :class:`~neutrain.errors.DataError` naming the file and the row.

Example:
    >>> json_depth(b'{"messages": [{"role": "user", "content": "[[[not nesting]]]"}]}')
    3
"""

from __future__ import annotations

import re

from neutrain.errors import DataError

MAX_LINE_BYTES = 16 << 20
MAX_JSON_DEPTH = 100
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)  # a JSON string: brackets inside it do not nest
_BRACKET = re.compile(rb"[\[\]{}]")


def json_depth(text: bytes, limit: int | None = None) -> int:
    """How deep arrays and objects nest in ``text`` (strings skipped); stops counting once past ``limit``."""
    depth = deepest = 0
    for m in _BRACKET.finditer(_STRING.sub(b'""', text)):
        depth += 1 if m.group() in b"[{" else -1
        if depth > deepest:
            deepest = depth
            if limit is not None and deepest > limit:
                break
    return deepest


def check_bounds(files: list[str], ds_type: str) -> None:
    """Refuse a file with a line over :data:`MAX_LINE_BYTES` or a JSON row nested over :data:`MAX_JSON_DEPTH`.

    Args:
        files: The data files of one dataset entry.
        ds_type: Their type (``json`` covers json and jsonl); parquet is binary and not scanned.
    """
    if ds_type not in ("json", "text", "csv"):
        return
    for f in files:
        with open(f, "rb") as fh:
            first = fh.read(1)
            fh.seek(0)
            if ds_type == "json" and first == b"[":  # one JSON document: its nesting counts as a whole
                _check_document(f, fh)
                continue
            for i, line in enumerate(iter(lambda: fh.readline(MAX_LINE_BYTES + 1), b"")):
                if len(line) > MAX_LINE_BYTES:
                    raise DataError(f"{f}: row {i} (line {i + 1}) is longer than {MAX_LINE_BYTES >> 20} MiB, neutrain's "
                                    "bound on a line; split it into shorter lines or rows")
                # A row cannot nest deeper than it has opening brackets: count exactly only when it might.
                if ds_type == "json" and line.count(b"[") + line.count(b"{") > MAX_JSON_DEPTH:
                    if json_depth(line, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
                        raise DataError(f"{f}: row {i} (line {i + 1}) nests arrays or objects more than {MAX_JSON_DEPTH} "
                                        "levels deep, neutrain's bound on JSON nesting")


def _check_document(name: str, fh) -> None:
    text = fh.read()
    if text.count(b"[") + text.count(b"{") > MAX_JSON_DEPTH and json_depth(text, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise DataError(f"{name}: nests arrays or objects more than {MAX_JSON_DEPTH} levels deep, neutrain's bound "
                        "on JSON nesting")
