"""A JSON data row whose object holds a key twice is refused before any reader sees it, naming the file, the row
and the key.

JSON leaves a duplicate key's meaning open and the readers disagree: Python keeps the last, and the reader
behind ``datasets`` read a row whose message held ``content`` twice as two rows, its ``messages`` list as one
mapping, so the run failed on "field 'messages' should be list, got dict" about a row that has a list. The
table puts the second key at each depth of each row kind, in a JSON-lines file and in one JSON document.
"""

from __future__ import annotations

import json

import pytest

from neutrain.cli import main
from neutrain.data.bounds import check_bounds
from neutrain.errors import DataError
from tests.helpers import one_error_line, write_recipe

ROWS = {
    "text at the top": ('{"text": "a", "text": "b"}', "text"),
    "completion at the top": ('{"prompt": "a", "completion": "b", "prompt": "c"}', "prompt"),
    "in a message": ('{"messages": [{"role": "user", "content": "x", "content": "y"}]}', "content"),
    "the list itself": ('{"messages": [], "messages": [{"role": "user", "content": "x"}]}', "messages"),
    "deep inside": ('{"meta": {"a": {"b": 1, "b": 2}}, "text": "t"}', "b"),
}
GOOD = '{"messages": [{"role": "user", "content": "\\"k\\": 1, \\"k\\": 2"}, {"role": "assistant", "content": "ok"}]}'


@pytest.mark.parametrize("layout", ["jsonl", "document"])
@pytest.mark.parametrize("name", ROWS)
def test_a_key_twice_in_one_object_is_named(tmp_path, name, layout):
    row, key = ROWS[name]
    path = tmp_path / f"rows.{'jsonl' if layout == 'jsonl' else 'json'}"
    path.write_text(GOOD + "\n" + row + "\n" if layout == "jsonl" else f"[{GOOD}, {row}]")
    with pytest.raises(DataError) as info:
        check_bounds([str(path)], "json")
    message = str(info.value)
    assert message.startswith(f"{path}: ") and f"the key '{key}' twice" in message, message
    if layout == "jsonl":
        assert "row 1 (line 2)" in message, message


def test_the_same_key_in_separate_objects_and_inside_strings_is_fine(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join([GOOD] * 3) + "\n")
    check_bounds([str(path)], "json")
    document = tmp_path / "rows.json"
    document.write_text(json.dumps([json.loads(GOOD)] * 3))
    check_bounds([str(document)], "json")


def test_train_names_the_row_not_a_shape_the_reader_made_up(tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    data.write_text(GOOD + "\n" + ROWS["in a message"][0] + "\n")
    recipe = write_recipe(tmp_path, data={"datasets": [{"path": str(data), "type": "messages"}], "chat_template": "chatml"},
                          train={"max_steps": 1})
    assert main(["train", str(recipe)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"neutrain: error: {data}: row 1 (line 2): an object holds the key 'content' twice"), line


JSON_FILES = {  # a file the user names, as a key or argument, read through the one reader
    "model.config": '{"model_type": "llama", "hidden_size": 32, "hidden_size": 64}',
    "train.fsdp_config": '{"fsdp_version": 2, "nested": {"a": 1, "a": 2}}',
    "train.deepspeed": '{"train_batch_size": 4, "train_batch_size": 8}',
}


@pytest.mark.parametrize("key", JSON_FILES)
def test_a_json_file_you_name_refuses_a_key_twice(tmp_path, capsys, key):
    path = tmp_path / "file.json"
    path.write_text(JSON_FILES[key])
    recipe = write_recipe(tmp_path, train={"max_steps": 1})
    assert main(["train", str(recipe), f"{key}={path}"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"neutrain: error: {key}: file '{path}' holds the key ") and "twice" in line, line


@pytest.mark.parametrize("text,key", [('{"a": 1, "a": 1}', "a"), ('[{"b": {"c": 1, "c": 2}}]', "c"),
                                      ('{"x": [{"y": 1}, {"y": 2, "z": 0, "y": 3}]}', "y")])
def test_the_one_reader_names_the_key_at_any_depth(text, key):
    from neutrain.files import parse_json

    with pytest.raises(ValueError, match=rf"^f\.json holds the key '{key}' twice in one object"):
        parse_json(text, "f.json", ValueError)
    assert parse_json('{"y": 1, "z": {"y": 2}}', "f.json", ValueError) == {"y": 1, "z": {"y": 2}}
