"""Every path argument of every command is held to what a path-valued recipe key is held to, naming the argument:
not empty, no surrounding whitespace, no control character, UTF-8, a length its file system holds.

Why: an empty argument was taken as none, or as the working folder: ``generate M --draft ''`` generated without
the draft, exit 0; ``generate M --input-file ''`` was a ``TypeError`` traceback; ``chat ''`` and ``export ''``
looked for a model in ``.``; ``eval CKPT --recipe ''`` asked for the ``--recipe`` it had been given. ``export
--output 'out '`` created a folder whose name ends in a space, and ``--output $'out\\n'`` one with a newline, where
``export.output_dir`` refuses both. The arguments are found by walking every command's parser, so a path argument
added later is covered or fails :func:`test_every_text_argument_is_a_checked_path_or_declared_as_text`.
"""

from __future__ import annotations

import argparse

import pytest

from tests.helpers import one_error_line

TEXT_NOT_PATH = {"overrides", "format", "prompt", "system"}
"""The string arguments that are not paths: dotted overrides (checked by the recipe's rules), a format name (checked
by the exporter), and text for the model."""

ARGUMENTS = {
    ("train", "recipe"): ["train", "{bad}"],
    ("estimate", "recipe"): ["estimate", "{bad}"],
    ("distill", "recipe"): ["distill", "{bad}"],
    ("eval", "target"): ["eval", "{bad}"],
    ("eval", "--recipe"): ["eval", "{tmp}", "--recipe", "{bad}"],
    ("export", "checkpoint"): ["export", "{bad}"],
    ("export", "--output"): ["export", "{tmp}", "--output", "{bad}"],
    ("export", "--base"): ["export", "{tmp}", "--base", "{bad}"],
    ("generate", "model"): ["generate", "{bad}", "--prompt", "hi"],
    ("generate", "--draft"): ["generate", "{tmp}", "--draft", "{bad}", "--prompt", "hi"],
    ("generate", "--input-file"): ["generate", "{tmp}", "--input-file", "{bad}"],
    ("chat", "model"): ["chat", "{bad}"],
}

BAD = {
    "empty": ("", "is empty or starts or ends with whitespace"),
    "a space": (" ", "is empty or starts or ends with whitespace"),
    "a trailing space": ("{tmp}/out ", "is empty or starts or ends with whitespace"),
    "a leading space": (" {tmp}/out", "is empty or starts or ends with whitespace"),
    "a newline": ("{tmp}/out\n", "contains the control character '\\n'"),
    "a tab inside": ("{tmp}/o\tut", "contains the control character '\\t'"),
    "a delete character": ("{tmp}/o\x7fut", "contains the control character '\\x7f'"),
    "a byte that is not UTF-8": ("{tmp}/o\udcffut", "not UTF-8"),
}


def _string_arguments() -> set[tuple[str, str]]:
    """``(command, argument)`` for every argument of every command that takes a string as it is typed."""
    from neutrain.cli.main import COMMANDS, _parser
    from neutrain.config.numbers import numeric_type

    found = set()
    for command in COMMANDS:
        sub = next(a for a in _parser(command)._actions if a.dest == "command").choices[command]
        for action in sub._actions:
            takes_text = action.nargs != 0 and not action.choices and numeric_type(action) is None
            if takes_text and action.dest not in TEXT_NOT_PATH and not isinstance(action, argparse._HelpAction):
                found.add((command, action.option_strings[-1] if action.option_strings else action.dest))
    return found


def test_every_text_argument_is_a_checked_path_or_declared_as_text():
    assert _string_arguments() == set(ARGUMENTS)


CASES = [(arg, bad) for arg in ARGUMENTS for bad in BAD]


@pytest.mark.parametrize("argument,bad", CASES, ids=[f"{c} {a}-{b}" for (c, a), b in CASES])
def test_a_path_argument_that_no_path_is_taken_as_is_refused_naming_it(tmp_path, capsys, argument, bad):
    from neutrain.cli import main

    value, said = BAD[bad]
    argv = [a.format(bad=value.format(tmp=tmp_path), tmp=tmp_path) for a in ARGUMENTS[argument]]
    assert main(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"neutrain: error: {' '.join(argument)}: ") and said in line, line
    assert not any(p.name.startswith("o") for p in tmp_path.iterdir()), "nothing is created under a refused name"
