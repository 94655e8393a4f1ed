"""Inputs that ended in a traceback now end in one line: exit 2 (or 1 for the environment), naming the culprit.

Before: ``neutrain generate`` with out-of-range numbers, an export whose ``tokenizer.json``
is malformed, chat templates with a syntax error, an unknown filter or an operation the sandbox refuses,
an ``output_dir`` with a NUL byte or (under ``LC_ALL=C``) a non-ASCII character, an unknown
``NEUTRAIN_LOG_LEVEL``, and a ``trainer_state.json`` with ``max_steps: null``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from neutrain.cli import main as neutrain
from tests.faults.test_data_errors import _no_progress_bars, _one_line_error, _recipe  # noqa: F401 (fixture)
from tests.faults.test_run_lifecycle import QUIET, _subprocess_env
from tests.helpers import TINY_LLAMA, write_recipe


@pytest.fixture(autouse=True)
def _no_transformers_bars():
    """transformers draws "Writing model shards" and "Loading weights" bars on stderr; off here."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    yield
    hf_logging.enable_progress_bar()


def _export(directory: Path, chat_template: str | None = None) -> Path:
    """A tiny random model exported with the byte tokenizer (its chat template replaced when given)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from neutrain.data import byte_tokenizer
    from neutrain.export import export_model

    tok = byte_tokenizer()
    if chat_template is not None:
        tok.chat_template = chat_template
    config = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}, vocab_size=len(tok))
    return Path(export_model(LlamaForCausalLM(config), directory, "hf", tokenizer=tok))


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    return _export(tmp_path_factory.mktemp("generate") / "export")


@pytest.mark.parametrize("flags, culprit", [
    (["--max-new-tokens", "-1"], "--max-new-tokens: -1 is out of range"),
    (["--temperature", "-1"], "--temperature: -1 is out of range"),
    (["--temperature", "nan"], "--temperature: nan is out of range"),
    (["--num-drafts", "0", "--draft", "SELF"], "--num-drafts: 0 is out of range"),
    (["--draft-len", "0", "--draft", "SELF"], "--draft-len: 0 is out of range"),
])
def test_generate_refuses_out_of_range_numbers_in_one_line(export, capsys, flags, culprit):
    flags = [str(export) if f == "SELF" else f for f in flags]
    line = _one_line_error(capsys, ["generate", str(export), "--prompt", "hi", "--max-new-tokens", "2", *flags])
    assert line.startswith(f"neutrain: error: {culprit}"), line


def test_generate_names_a_malformed_tokenizer_json(export, tmp_path, capsys):
    from neutrain.storage.manifest import write_manifest

    broken = tmp_path / "broken"
    shutil.copytree(export, broken)
    tokenizer = json.loads((broken / "tokenizer.json").read_text())
    del tokenizer["added_tokens"]
    (broken / "tokenizer.json").write_text(json.dumps(tokenizer))
    (broken / "neutrain_manifest.json").unlink()
    write_manifest(broken)  # the checksums match: the file is malformed, not corrupted
    line = _one_line_error(capsys, ["generate", str(broken), "--prompt", "hi", "--max-new-tokens", "2"])
    assert f"tokenizer files in '{broken}' cannot be loaded (KeyError" in line and "added_tokens" in line


@pytest.mark.parametrize("template, said", [
    ("{% for m in messages %}{{ m.content }", "the chat template is not valid Jinja (line 1: unexpected '}')"),
    ("{{ messages | no_such_filter }}", "the chat template is not valid Jinja (line 1: No filter named 'no_such_filter'"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "the chat template tried an operation the sandbox forbids"),
])
def test_generate_reports_a_bad_chat_template_in_one_line(tmp_path, capsys, template, said):
    model = _export(tmp_path / "export", chat_template=template)
    line = _one_line_error(capsys, ["generate", str(model), "--prompt", "hi", "--max-new-tokens", "2"])
    assert line == f"neutrain: error: {model}: {said}" or line.startswith(f"neutrain: error: {model}: {said}"), line
    if "sandbox" in said:
        assert "the sandbox refused it and nothing unsafe ran" in line


def test_training_names_the_row_a_bad_chat_template_failed_on(tmp_path, capsys):
    rows = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n"
    recipe = _recipe(tmp_path, {"chat.jsonl": rows}, [{"path": "chat.jsonl", "type": "messages"}],
                     data={"chat_template": "{% for m in messages %}{{ m.content | shout }}{% endfor %}"})
    line = _one_line_error(capsys, ["train", str(recipe)])
    assert line == (f"neutrain: error: {tmp_path / 'chat.jsonl'}: row 0: the chat template is not valid Jinja "
                    "(line 1: No filter named 'shout'.)"), line


def test_an_output_dir_with_a_nul_byte_is_refused(tmp_path, capsys):
    recipe = write_recipe(tmp_path, train={"output_dir": str(tmp_path / "a\0b")}, **QUIET)
    line = _one_line_error(capsys, ["train", str(recipe)])
    assert line.startswith("neutrain: error: train.output_dir: ") and "contains a NUL byte" in line


def test_a_non_ascii_output_dir_under_lc_all_c_is_refused(tmp_path):
    recipe = write_recipe(tmp_path, train={"output_dir": str(tmp_path / "sortie-é")}, **QUIET)
    env = {**_subprocess_env(), "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    res = subprocess.run([sys.executable, "-m", "neutrain", "train", str(recipe)], env=env, capture_output=True,
                         text=True, encoding="utf-8", errors="replace", timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("neutrain: error: train.output_dir: "), res.stderr[-2000:]
    assert "file-system encoding (ascii" in lines[0] and "LC_ALL=C.UTF-8" in lines[0]


def test_an_unknown_log_level_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("NEUTRAIN_LOG_LEVEL", "verbose")
    line = _one_line_error(capsys, ["recipes"])
    assert line == ("neutrain: error: environment variable NEUTRAIN_LOG_LEVEL='verbose': not a log level; expected a log "
                    "level (DEBUG, INFO, WARNING, ERROR, CRITICAL, any case) or a number from 0 to 50 (the level of "
                    "neutrain's log lines)")
    monkeypatch.setenv("NEUTRAIN_LOG_LEVEL", "warning")  # any case of a real level is fine
    assert neutrain(["recipes"]) == 0


def test_trainer_state_with_max_steps_null_is_named(tmp_path, capsys):
    recipe = write_recipe(tmp_path, **QUIET)
    checkpoint = tmp_path / "out" / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 2, "max_steps": None, "epoch": 0.1}))
    line = _one_line_error(capsys, ["train", str(recipe), f"train.resume_from_checkpoint={checkpoint}",
                                    f"train.output_dir={tmp_path / 'resumed'}"])
    assert line == (f"neutrain: error: checkpoint '{checkpoint}': trainer_state.json has max_steps: null, expected a "
                    "number; resume from an earlier checkpoint-N")
