"""Hostile data files are refused in one line, before a native parser can crash on them.

Before: a jsonl row nested 100,000 deep crashed pyarrow (SIGSEGV, exit 139, no message) or
raised RecursionError; a 207 MB single-line text file aborted the tokenizer's Rust code (exit 134). Both
are now bounded (neutrain.data.bounds, stated in docs/models-and-data.md): exit 2, one line naming the
file and the row.
"""

from __future__ import annotations

import json

import pytest

from tests.faults.test_data_errors import _jsonl, _no_progress_bars, _one_line_error, _recipe  # noqa: F401 (fixture)


def test_a_row_nested_100000_deep_is_refused_naming_file_and_row(tmp_path, capsys):
    deep = '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}"
    rows = _jsonl([{"text": "an ordinary first row"}, deep, {"text": "after"}])
    recipe = _recipe(tmp_path, {"deep.jsonl": rows}, [{"path": "deep.jsonl", "type": "text"}])
    line = _one_line_error(capsys, ["train", str(recipe)])
    assert f"{tmp_path / 'deep.jsonl'}: row 1 (line 2) nests arrays or objects more than 100 levels" in line


def test_a_json_array_file_nested_too_deep_is_refused(tmp_path, capsys):
    text = '[{"text": "a", "x": ' + "[" * 5000 + "]" * 5000 + "}]"
    recipe = _recipe(tmp_path, {"deep.json": text}, [{"path": "deep.json", "type": "text"}])
    assert f"{tmp_path / 'deep.json'}: nests arrays or objects more than" in _one_line_error(capsys, ["train", str(recipe)])


def test_a_line_longer_than_the_bound_is_refused_before_the_tokenizer_sees_it(tmp_path, capsys):
    big = tmp_path / "big.txt"
    with open(big, "wb") as fh:
        fh.write(b"short first line\n")
        fh.write(b"x" * ((16 << 20) + 10))  # one line, no newline: what aborted the tokenizer at 207 MB
    recipe = _recipe(tmp_path, {}, [{"path": "big.txt", "type": "text"}])
    line = _one_line_error(capsys, ["train", str(recipe)])
    assert f"{big}: line 2 is longer than 16 MiB" in line


def test_brackets_inside_strings_do_not_count_and_ordinary_nesting_passes():
    from neutrain.data.bounds import MAX_JSON_DEPTH, json_depth

    assert json_depth(json.dumps({"text": "[" * 1000}).encode()) == 1
    assert json_depth(json.dumps({"text": "\\\"[[["}).encode()) == 1  # escaped quote stays inside the string
    nested = json.dumps({"messages": [{"role": "user", "content": "hi", "meta": {"a": [[1]]}}]}).encode()
    assert json_depth(nested) == 6
    assert json_depth(b"[" * 500 + b"]" * 500, limit=MAX_JSON_DEPTH) == MAX_JSON_DEPTH + 1  # stops counting early


def test_a_row_at_the_bound_still_loads(tmp_path):
    from neutrain.data.bounds import MAX_JSON_DEPTH, check_bounds

    depth = MAX_JSON_DEPTH
    ok = tmp_path / "ok.jsonl"
    ok.write_text(json.dumps({"text": "a", "x": json.loads("[" * (depth - 1) + "]" * (depth - 1))}) + "\n")
    check_bounds([str(ok)], "json")  # raises nothing
