"""A prompt is bounded where it is read, and one past the model's context is named as the prompt's fault.

Why: ``neutrain chat MODEL < /dev/zero`` read one endless line into memory and never answered (no newline ever
came); ``generate --prompt`` of 100,000 tokens on a model of 256 positions said "--max-new-tokens: ... ask for at
most 0", blaming the one number that was fine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import finished_run, one_error_line


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    out = finished_run(tmp_path_factory.mktemp("model"), train={"max_steps": 2, "save_steps": 2},
                       eval={"perplexity": False})
    return out / "export"


@pytest.mark.parametrize("stdin", ["/dev/zero", "one long line"])
def test_chat_refuses_a_line_past_its_bound_instead_of_reading_forever(export, tmp_path, stdin):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if stdin == "one long line":
        stdin = tmp_path / "line.txt"
        stdin.write_text("a" * ((1 << 22) + 10))
    with open(stdin, "rb") as source:
        done = subprocess.run([sys.executable, "-m", "neutrain", "chat", str(export), "--raw"], stdin=source,
                              capture_output=True, text=True, env=env, timeout=120, errors="replace")
    assert done.returncode == 2, done.stderr[-2000:]
    line = one_error_line(done.stderr)
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
