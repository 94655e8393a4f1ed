"""Data that trains less than it looks: a role no template knows and the recipe does not train is named once per
file; a data folder is described by what it holds, whatever its name."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings, strategies as st

from neutrain.config import DataError
from neutrain.config.sections import DataSection
from neutrain.data import byte_tokenizer
from neutrain.data import formats
from neutrain.data.formats import CHAT_ROLES, tokenize_row
from neutrain.data.sources import _ds_type

CFG = DataSection.model_construct(sequence_len=256, train_on_inputs=False, roles_to_train=["assistant"])
ENTRY = {"path": "x", "type": "messages", "ds_type": None, "split": "train", "text_field": "text",
         "prompt_field": "prompt", "completion_field": "completion", "messages_field": "messages", "max_files": None}


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(autouse=True)
def fresh_warnings():
    formats._WARNED_ROLES.clear()
    yield
    formats._WARNED_ROLES.clear()


def _rows(tok, role, n, source="chat.jsonl"):
    for index in range(n):
        msgs = [{"role": "user", "content": "hi"}, {"role": role, "content": "hello"}]
        tokenize_row({"messages": msgs}, tok, ENTRY, CFG, source, index)


@given(role=st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12)
       .filter(lambda r: r not in CHAT_ROLES and r != "assistant"))
@settings(max_examples=25, deadline=None)
def test_an_untrained_unknown_role_is_named_once_per_file(role):
    tok = byte_tokenizer()
    formats._WARNED_ROLES.clear()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("neutrain")
    logger.addHandler(handler)
    try:
        _rows(tok, role, 3)
        _rows(tok, role, 2, source="other.jsonl")
    finally:
        logger.removeHandler(handler)
    lines = [r.getMessage() for r in records if f"role '{role}'" in r.getMessage()]
    assert len(lines) == 2, lines  # once a file, not once a row
    assert "chat.jsonl: row 0:" in lines[0] and "data.roles_to_train" in lines[0] and "not trained" in lines[0]


@pytest.mark.parametrize("role", sorted(CHAT_ROLES))
def test_common_roles_are_not_named(tok, role, caplog):
    with caplog.at_level(logging.WARNING, logger="neutrain"):
        _rows(tok, role, 2)
    assert "not trained" not in caplog.text


def test_a_listed_role_is_trained_and_not_named(tok, caplog):
    with caplog.at_level(logging.WARNING, logger="neutrain"):
        msgs = [{"role": "user", "content": "hi"}, {"role": "gpt", "content": "hello"}]
        (row,) = tokenize_row({"messages": msgs}, tok, ENTRY, CFG.changed(roles_to_train=["gpt"]), "f.jsonl", 0)
    assert "not trained" not in caplog.text
    assert any(label != -100 for label in row["labels"])


@pytest.mark.parametrize("name", ["data.jsonl", "data.csv", "plain", "data.txt"])
def test_an_empty_data_folder_is_named_as_a_folder_whatever_its_name(tmp_path, name):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "notes.bin").write_bytes(b"\0")
    with pytest.raises(DataError, match=r"directory holds no .*\.jsonl.* files"):
        _ds_type(folder, None)


def test_a_folder_of_mixed_types_names_the_types(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "b.csv").write_text("text\nx\n")
    with pytest.raises(DataError, match=r"several types \(csv, json\)"):
        _ds_type(tmp_path, None)
    (tmp_path / "b.csv").unlink()
    (tmp_path / "c.json").write_text('[{"text": "x"}]')
    assert _ds_type(tmp_path, None) == "json"  # .json and .jsonl are one reader


def test_a_file_with_an_unknown_extension_names_it(tmp_path):
    f = tmp_path / "rows.data"
    f.write_text("x")
    with pytest.raises(DataError, match=r"extension '\.data'"):
        _ds_type(f, None)


@pytest.mark.parametrize("bom, encoding", [(b"\xff\xfe", "UTF-16"), (b"\xfe\xff", "UTF-16"),
                                           (b"\xff\xfe\x00\x00", "UTF-32")])
def test_a_byte_order_mark_over_bytes_of_another_encoding_says_so(bom, encoding):
    """A file that starts with a UTF-16 or UTF-32 mark but whose bytes are not that encoding: one line that says
    both, not "is not UTF-16 (by its byte-order mark) text"."""
    from neutrain.files import decode_text

    data = bom + b"\x00\xd8\x00\xd8abc"  # lone surrogates in either byte order
    with pytest.raises(ValueError, match=rf"^f\.txt starts with a {encoding}(-LE|-BE)? byte-order mark but is not"):
        decode_text(data, "f.txt", ValueError)
