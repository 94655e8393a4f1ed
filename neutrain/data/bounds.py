"""Bounds on a data file's lines and JSON nesting, checked before any parser sees the file.

Why: the parsers behind ``datasets`` are native code, and hostile input crashed them without a
word: a JSON row nested 100,000 levels deep killed pyarrow with SIGSEGV (exit 139) or raised
``RecursionError``, and a 207 MB single-line text file aborted the tokenizer's Rust code (exit
134). Neither can be caught once it happens, so every json, jsonl, csv and text file is scanned
first, with plain byte operations:

* a line holds at most :data:`MAX_LINE_BYTES` (16 MiB: a row of 16 MiB of text is about 4M
  tokens, far beyond any ``sequence_len``);
* a JSON row nests at most :data:`MAX_JSON_DEPTH` (100) arrays and objects (chat data nests 3);
* the file is UTF-8 text (a UTF-8 byte-order mark is fine): a UTF-16 or UTF-32 file (told by its mark)
  and a line that is not UTF-8 are named, with the line and byte, instead of a ``UnicodeDecodeError``
  from the reader with no row;
* no JSON string holds a lone surrogate (a ``\\ud800`` escape no low surrogate follows): Python's
  parser takes it, but it is no character, and ``datasets`` then failed with no row named;
* no JSON object of a row holds a key twice (the readers disagree on which counts: ``datasets`` read such a
  row as two rows of another shape).

A file over a bound is a :class:`~neutrain.errors.DataError` naming the file, the row and (for a
surrogate) the key.

Example:
    >>> json_depth(b'{"messages": [{"role": "user", "content": "[[[not nesting]]]"}]}')
    3
"""

from __future__ import annotations

import codecs
import json
import re

from neutrain.errors import DataError
from neutrain.files import DuplicateKey, detect_encoding, lone_surrogate, unique_keys

MAX_LINE_BYTES = 16 << 20
MAX_JSON_DEPTH = 100
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)  # a JSON string: brackets inside it do not nest
_BRACKET = re.compile(rb"[\[\]{}]")
_SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")  # \ud800-\udfff written as a JSON escape


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
            head = fh.read(4)
            encoding = detect_encoding(head)
            if encoding != "utf-8" and encoding != "utf-8-sig":
                raise DataError(f"{f}: is {encoding.upper()} text (by its byte-order mark); data files are read as "
                                f"UTF-8: convert it (iconv -f {encoding.upper()} -t UTF-8)")
            start = len(codecs.BOM_UTF8) if encoding == "utf-8-sig" else 0
            fh.seek(start)
            if ds_type == "json" and head[start:start + 1] == b"[":  # one JSON document: its nesting counts as a whole
                _check_document(f, fh)
                continue
            for i, line in enumerate(iter(lambda: fh.readline(MAX_LINE_BYTES + 1), b"")):
                where = f"row {i} (line {i + 1})" if ds_type == "json" else f"line {i + 1}"
                if len(line) > MAX_LINE_BYTES:
                    raise DataError(f"{f}: {where} is longer than {MAX_LINE_BYTES >> 20} MiB, neutrain's "
                                    "bound on a line; split it into shorter lines or rows")
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise DataError(f"{f}: {where} is not UTF-8 text (byte 0x{line[exc.start]:02x} at offset "
                                    f"{exc.start} of the line); save the file as UTF-8") from None
                # A row cannot nest deeper than it has opening brackets: count exactly only when it might.
                if ds_type == "json" and line.count(b"[") + line.count(b"{") > MAX_JSON_DEPTH:
                    if json_depth(line, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
                        raise DataError(f"{f}: row {i} (line {i + 1}) nests arrays or objects more than {MAX_JSON_DEPTH} "
                                        "levels deep, neutrain's bound on JSON nesting")
                if ds_type == "json" and b'":' in line.replace(b'" :', b'":'):  # an object: its keys, its strings
                    _check_row(f, where, line)


def _check_row(name: str, where: str, line: bytes) -> None:
    """One JSON row: no object holding a key twice, no lone surrogate in a string.

    Why duplicate keys: JSON leaves their meaning open, and the readers disagree. Python keeps the last; the
    reader behind ``datasets`` read a row whose message held ``content`` twice as two rows and its
    ``messages`` list as one mapping, so the run failed on "field 'messages' should be list, got dict"
    about a row that has a list (or, with other shapes, trained on rows the file does not hold).
    """
    row = _parsed(f"{name}: {where}", line)
    if row is not _NOT_JSON and _SURROGATE_ESCAPE.search(line):
        _refuse_lone_surrogate(f"{name}: {where}", row)


def _check_document(name: str, fh) -> None:
    text = fh.read()
    try:
        text.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = text.count(b"\n", 0, exc.start) + 1
        raise DataError(f"{name}: is not UTF-8 text (byte 0x{text[exc.start]:02x} at line {line}); save the file "
                        "as UTF-8") from None
    if text.count(b"[") + text.count(b"{") > MAX_JSON_DEPTH and json_depth(text, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise DataError(f"{name}: nests arrays or objects more than {MAX_JSON_DEPTH} levels deep, neutrain's bound "
                        "on JSON nesting")
    rows = _parsed(name, text)
    for i, row in enumerate(rows if isinstance(rows, list) else []):
        _refuse_lone_surrogate(f"{name}: row {i}", row)


_NOT_JSON = object()


def _parsed(label: str, data: bytes):
    """``data`` parsed, refusing an object that holds a key twice (named with ``label``); ``_NOT_JSON`` when it is
    no JSON at all (the reader's own error names it)."""
    try:
        return json.loads(data, object_pairs_hook=unique_keys)
    except DuplicateKey as exc:
        raise DataError(f"{label}: an object holds the key '{exc.key}' twice; JSON does not say which one counts, "
                        "and the readers disagree: keep one") from None
    except (ValueError, RecursionError):
        return _NOT_JSON


def _refuse_lone_surrogate(label: str, row) -> None:
    found = lone_surrogate(row)
    if found is not None:
        raise DataError(f"{label}: key '{found[0]}' holds a lone surrogate {found[1]!r} (half of a UTF-16 pair, no "
                        "character): not valid Unicode text; fix or drop the row")
