"""One reader for every file the user names: its kind checked before it is opened, a size bound, the encoding
detected, and every parse error one line naming the file, the row and the key.

``neutrain train <a FIFO>``, ``train /dev/zero`` and ``distill /dev/zero`` said "recipe file ... does not
exist"; ``train.fsdp_config=<a FIFO>`` hung; a lone surrogate in a messages row ended in a
``DatasetGenerationError`` with no row named. The table below puts each kind of file (missing, a directory,
a FIFO, a character device, a dangling link, a file in another encoding, a file too large) in each place a
user names a file, and each must be refused in one line with the right word, at once (nothing blocks).
"""

from __future__ import annotations

import codecs
import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neutrain.cli import main
from neutrain.config import RecipeError
from neutrain.config.recipe_yaml import parse_recipe_text
from neutrain.errors import UserInputError
from tests.helpers import TINY_LLAMA, one_error_line, write_recipe

KINDS = {  # kind -> (how it is made under a path, the word the refusal must use)
    "missing": (lambda p: None, "does not exist"),
    "directory": (lambda p: p.mkdir(), "is a directory, not a regular file"),
    "fifo": (lambda p: os.mkfifo(p), "is a FIFO (named pipe), not a regular file"),
    "device": (lambda p: p.symlink_to("/dev/zero"), "is a character device, not a regular file"),
    "dangling": (lambda p: p.symlink_to(p.parent / "gone"), "does not exist (it is a symbolic link to a missing path)"),
}


def _made(tmp_path, kind: str, name: str):
    path = tmp_path / name
    KINDS[kind][0](path)
    return path


def _run(capsys, argv) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    return one_error_line(err)


# Each place a file is named: (name of the file, argv with {f} for it, what the line starts with, what it must be).
READERS = {
    "train recipe": ("r.yaml", ["train", "{f}"], "recipe file '{f}'"),
    "default command recipe": ("r.yml", ["{f}"], "recipe file '{f}'"),
    "distill recipe": ("r.yaml", ["distill", "{f}"], "recipe file '{f}'"),
    "estimate recipe": ("r.yaml", ["estimate", "{f}"], "recipe file '{f}'"),
    "eval --recipe": ("r.yaml", ["eval", "{dir}", "--recipe", "{f}"], "recipe file '{f}'"),
    "train.fsdp_config": ("fsdp.json", ["train", "{recipe}", "train.fsdp_config={f}"], "train.fsdp_config: file '{f}'"),
    "train.deepspeed": ("ds.json", ["train", "{recipe}", "train.deepspeed={f}"], "train.deepspeed: file '{f}'"),
    "model.config": ("config.json", ["train", "{recipe}", "model.config={f}"], "model.config: file '{f}'"),
    "data file": ("d.jsonl", ["train", "{recipe}", "data.datasets=[{{path: '{f}', type: text}}]"],
                  "data.datasets[0].path: data file '{f}'"),
    "gguf file": ("m.gguf", ["train", "{recipe}", "model.gguf_file={f}", "model.init=pretrained",
                             "model.config=null", "model.tokenizer=null"], "model.gguf_file: '{f}'"),
    "generate model": ("model", ["generate", "{f}", "--prompt", "hi"], "checkpoint '{f}'", "dir"),
    "export checkpoint": ("ckpt-x", ["export", "{f}"], "checkpoint '{f}'", "dir"),
    "model.tokenizer": ("tok", ["train", "{recipe}", "model.tokenizer={f}"], "model.tokenizer: '{f}'", "dir"),
}
WANTED = {"file": "not a regular file", "dir": "not a directory", "any": "not a regular file or a directory"}


def _argv(tmp_path, reader: str, path) -> tuple[list[str], str]:
    name, argv, head = READERS[reader][:3]
    recipe = write_recipe(tmp_path / "recipe")
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    fill = {"f": str(path), "recipe": str(recipe), "dir": str(tmp_path / "ckpt")}
    return [a.format(**fill) for a in argv], head.format(**fill)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("reader", sorted(READERS))
def test_every_file_a_user_names_is_refused_by_its_kind_in_one_line(tmp_path, capsys, reader, kind):
    want = "any" if reader == "data file" else READERS[reader][3] if len(READERS[reader]) > 3 else "file"
    if kind == "directory" and want != "file":
        pytest.skip("a directory is what this reader takes")
    path = _made(tmp_path, kind, READERS[reader][0])
    argv, head = _argv(tmp_path, reader, path)
    line = _run(capsys, argv)
    word = KINDS[kind][1].replace("not a regular file", WANTED[want])
    assert line.startswith(f"neutrain: error: {head}") and word in line, line


@pytest.mark.parametrize("reader", ["train.fsdp_config", "train.deepspeed", "model.config"])
@pytest.mark.parametrize("content,said", [
    (b"{\"a\": 1,}", "is not valid JSON (Expecting property name enclosed in double quotes at line 1, column 9)"),
    (b"[1, 2]", "holds a JSON list, expected an object"),
    (b"{\"a\": \"caf\xe9\"}", "is not UTF-8 text (byte 0xe9 at line 1, offset 10)"),
    (b"{\"a\": \"\\ud800\"}", "key 'a' holds a lone surrogate"),
    (b"{\"a\": 1}" + b" " * (16 << 20), "is 16,777,224 bytes, more than the 16 MiB such a file may hold"),
])
def test_a_json_config_the_user_names_is_read_by_the_one_reader(tmp_path, capsys, reader, content, said):
    path = tmp_path / READERS[reader][0]
    path.write_bytes(content)
    argv, head = _argv(tmp_path, reader, path)
    line = _run(capsys, argv)
    assert line.startswith(f"neutrain: error: {head}") and said in line, line


def test_a_json_config_in_utf16_is_read(tmp_path):
    from neutrain.files import read_json_object

    path = tmp_path / "fsdp.json"
    path.write_bytes(codecs.BOM_UTF16_LE + json.dumps({"fsdp_version": 2}).encode("utf-16-le"))
    assert read_json_object(path, "train.fsdp_config", RecipeError) == {"fsdp_version": 2}


@pytest.mark.parametrize("name,content,said", [
    ("chats.jsonl", b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo \\ud800"}]}\n',
     "row 0 (line 1): key 'messages[1].content' holds a lone surrogate '\\ud800'"),
    ("chats.json", b'[{"messages": [{"role": "user", "content": "\\udc00"}]}]',
     "row 0: key 'messages[0].content' holds a lone surrogate '\\udc00'"),
    ("text.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "row 1 (line 2) is not UTF-8 text (byte 0xe9 at offset 13 of the line)"),
    ("text.jsonl", codecs.BOM_UTF16_LE + '{"text": "ok"}\n'.encode("utf-16-le"), "is UTF-16 text (by its byte-order mark)"),
    ("notes.txt", b"caf\xe9\n", "line 1 is not UTF-8 text"),
])
def test_a_data_file_that_is_not_text_names_its_row_and_key(tmp_path, capsys, name, content, said):
    path = tmp_path / name
    path.write_bytes(content)
    kind = "messages" if "chats" in name else "text"
    recipe = write_recipe(tmp_path, data={"datasets": [{"path": str(path), "type": kind}]}, export={"format": "none"},
                          eval={"perplexity": False})
    line = _run(capsys, ["train", recipe])
    assert line.startswith(f"neutrain: error: {path}: ") and said in line, line


def test_a_fifo_inside_a_tokenizer_folder_is_refused_before_transformers_opens_it(tmp_path, capsys):
    from neutrain.data import byte_tokenizer

    folder = tmp_path / "tok"
    byte_tokenizer().save_pretrained(folder)
    (folder / "tokenizer.json").unlink()
    os.mkfifo(folder / "tokenizer.json")
    line = _run(capsys, ["train", write_recipe(tmp_path), f"model.tokenizer={folder}"])
    assert line == (f"neutrain: error: model.tokenizer: '{folder}' holds tokenizer.json, which is a FIFO (named pipe), "
                    "not a regular file")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_as_a_recipe_are_a_recipe_or_one_line(data):
    try:
        parse_recipe_text(data, "r.yaml")
    except RecipeError as exc:
        assert str(exc).startswith("r.yaml") and "\n" not in str(exc)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=120), st.text(max_size=60).map(lambda t: t.encode("utf-8", "surrogatepass")),
                 st.recursive(st.one_of(st.text(max_size=5), st.floats(), st.integers()),
                              lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                              max_leaves=5).map(lambda v: json.dumps({"k": v}).encode())))
def test_any_bytes_as_a_json_config_are_an_object_or_one_line(tmp_path_factory, data):
    from neutrain.files import read_json_object

    path = tmp_path_factory.mktemp("j") / "c.json"
    path.write_bytes(data)
    try:
        value = read_json_object(path, "train.deepspeed: file 'c.json'", RecipeError)
    except UserInputError as exc:
        assert str(exc).startswith("train.deepspeed: file 'c.json'") and "\n" not in str(exc)
    else:
        assert isinstance(value, dict)


def test_a_model_config_given_inline_is_still_checked_as_a_mapping(tmp_path):
    from neutrain.config import load_recipe

    assert load_recipe(write_recipe(tmp_path, model={"config": TINY_LLAMA})).model.config["hidden_size"] == 32


def test_a_csv_that_does_not_parse_is_one_line_naming_the_file_and_row(tmp_path, capsys):
    path = tmp_path / "rows.csv"
    path.write_text('text,label\nhello,1\n"unterminated,2\n')
    recipe = write_recipe(tmp_path, data={"datasets": [{"path": str(path), "type": "text"}]}, export={"format": "none"},
                          eval={"perplexity": False})
    assert main(["train", str(recipe)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"neutrain: error: {path}: could not be read as csv") \
        and "row 2" in lines[0], lines
