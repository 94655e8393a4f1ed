"""A prompt is bounded where it is read, and one past the model's context is named as the prompt's fault.

Why: ``neutrain chat MODEL < /dev/zero`` read one endless line into memory and never answered (no newline ever
came); ``generate --prompt`` of 100,000 tokens on a model of 256 positions said "--max-new-tokens: ... ask for at
most 0", blaming the one number that was fine.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from tests.helpers import one_error_line


@pytest.fixture(scope="module")
def export(tiny_run) -> Path:
    return tiny_run / "export"  # the session's finished tiny run (tests/faults/conftest.py), read only


class _Capped(io.RawIOBase):
    """A file read through a cap: past 64 MiB the bound under test is gone (fail, not read memory full)."""

    def __init__(self, source):
        self.source, self.read_bytes = source, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        self.read_bytes += len(buffer)
        assert self.read_bytes <= 1 << 26, "stdin was read past 64 MiB: the line has no bound"
        return self.source.readinto(buffer)


@pytest.mark.parametrize("stdin", ["/dev/zero", "one long line"])
def test_chat_refuses_a_line_past_its_bound_instead_of_reading_forever(export, tmp_path, capsys, monkeypatch, stdin):
    from neutrain.cli import main

    if stdin == "one long line":
        stdin = tmp_path / "line.txt"
        stdin.write_text("a" * ((1 << 22) + 10))
    # In this process, stdin read as `neutrain chat` reads its own (text, from the file's bytes): no start-up.
    with open(stdin, "rb") as source:
        reader = io.BufferedReader(_Capped(source))
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(reader, encoding="utf-8", errors="replace"))
        assert main(["chat", str(export), "--raw"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "stdin" in line and "characters" in line, line


@pytest.mark.parametrize("command", ["generate", "generate --raw"])
def test_a_prompt_past_the_context_is_named_as_the_prompt(export, capsys, command):
    from neutrain.cli import main

    argv = ["generate", str(export), "--prompt", "x" * 1000, "--max-new-tokens", "2", *command.split()[1:]]
    assert main(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("neutrain: error: --prompt:") and "256 positions" in line and "at most 0" not in line, line


@pytest.mark.parametrize("raw", [False, True])
def test_an_empty_prompt_is_one_line_not_a_traceback(export, capsys, raw):
    from neutrain.cli import main

    assert main(["generate", str(export), "--prompt", "", "--max-new-tokens", "2", *(["--raw"] if raw else [])]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("neutrain: error: --prompt:") and "empty" in line, line


@pytest.mark.parametrize("name,text", [("empty.txt", ""), ("blank.txt", "\n \n\n"), ("empty.jsonl", ""),
                                       ("empty-prompt.jsonl", '{"prompt": ""}\n')])
def test_an_input_file_without_a_prompt_is_one_line_naming_it(export, tmp_path, capsys, name, text):
    from neutrain.cli import main

    (tmp_path / name).write_text(text)
    assert main(["generate", str(export), "--input-file", str(tmp_path / name), "--max-new-tokens", "2"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"neutrain: error: --input-file: '{tmp_path / name}'") and "prompt" in line, line
