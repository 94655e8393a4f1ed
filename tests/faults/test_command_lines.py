"""Any bad command line, of any command, is one line naming the command and the argument, exit 2: a missing
argument, an unknown or abbreviated option, a flag without its value, an invalid choice, two exclusive flags, and a
value-taking flag given twice; a `--` before the overrides ends the options.

Why: argparse printed its usage text (up to nine lines) above each such error; it took a prefix of an option for the
option (``--out`` for ``--output``), so a working command line could change its meaning when a command gains an
option; ``--prompt a --prompt b`` answered ``b`` alone, exit 0; ``eval CKPT --recipe R -- key=value`` was refused.
The options are found by walking every command's parser, so an option added later is covered.
"""

from __future__ import annotations

import argparse

import pytest

from tests.helpers import one_error_line

REQUIRED = {"train": ["r.yaml"], "eval": ["ckpt"], "export": ["ckpt"], "estimate": ["r.yaml"], "distill": ["r.yaml"],
            "generate": ["m"], "chat": ["m"], "recipes": []}
"""Each command's positional arguments (none is looked at: the command line is refused before)."""


def _options() -> list[tuple[str, argparse.Action]]:
    """``(command, action)`` for every option of every command (``--help`` aside)."""
    from neutrain.cli.main import COMMANDS, _parser

    found = []
    for command in COMMANDS:
        sub = next(a for a in _parser(command)._actions if a.dest == "command").choices[command]
        found += [(command, a) for a in sub._actions if a.option_strings and a.dest != "help"]
    return found


OPTIONS = _options()


def _value(action: argparse.Action) -> str:
    """A value ``action`` takes."""
    from neutrain.config.numbers import numeric_type

    if action.choices:
        return str(list(action.choices)[0])
    rule = numeric_type(action)
    if rule is not None:
        return "1GB" if rule.kind == "size" else str(rule.high if rule.kind is int else 1.0)
    return "hf" if action.dest == "format" else "x"


def _refused(argv: list[str], capsys) -> str:
    """The one line ``neutrain <argv>`` is refused with (exit 2, no usage text, no traceback)."""
    from neutrain.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "usage:" not in err, err
    return one_error_line(err)


def test_every_command_has_options_and_every_value_option_is_walked():
    commands = {command for command, _ in OPTIONS}
    assert {"eval", "export", "generate", "chat", "distill", "recipes"} <= commands, commands
    assert sum(a.nargs != 0 for _, a in OPTIONS) >= 20


@pytest.mark.parametrize("command", sorted(c for c, args in REQUIRED.items() if args))
def test_a_missing_argument_is_one_line_naming_only_it(capsys, command):
    line = _refused([command], capsys)
    name = {"eval": "target", "export": "checkpoint", "generate": "model", "chat": "model"}.get(command, "recipe")
    assert line == f"neutrain: error: {command}: the following arguments are required: {name}", line


@pytest.mark.parametrize("command", sorted(REQUIRED))
def test_an_unknown_option_is_one_line_naming_it(capsys, command):
    line = _refused([command, *REQUIRED[command], "--no-such-option"], capsys)
    assert line.startswith(f"neutrain: error: {command}: unknown option '--no-such-option'"), line


ABBREVIATED = [(c, a.option_strings[-1]) for c, a in OPTIONS
               if len(a.option_strings[-1]) > 4 and a.option_strings[-1][:-1] not in
               {s for cc, aa in OPTIONS if cc == c for s in aa.option_strings}]


@pytest.mark.parametrize("command,flag", ABBREVIATED, ids=[f"{c}{f}" for c, f in ABBREVIATED])
def test_an_abbreviated_option_is_refused_naming_the_whole_one(capsys, command, flag):
    short = flag[:-1] if len(flag) < 8 else flag[:5]
    action = next(a for c, a in OPTIONS if c == command and flag in a.option_strings)
    value = [_value(action)] if action.nargs != 0 else []
    for argv in ([short, *value], [f"{short}={value[0]}"] if value else [short]):
        line = _refused([command, *REQUIRED[command], *argv], capsys)
        assert line.startswith(f"neutrain: error: {command}: unknown option '{short}' (did you mean "), line
        assert f"'{flag}'" in line, line


VALUED = [(c, a) for c, a in OPTIONS if a.nargs != 0]


@pytest.mark.parametrize("command,action", VALUED, ids=[f"{c}{a.option_strings[-1]}" for c, a in VALUED])
def test_a_value_option_given_twice_is_refused_naming_both_values(capsys, command, action):
    flag, value = action.option_strings[-1], _value(action)
    for twice in ([flag, value, flag, value], [f"{flag}={value}", flag, value]):
        line = _refused([command, *REQUIRED[command], *twice], capsys)
        assert line.startswith(f"neutrain: error: {command}: {flag} given twice ("), line


@pytest.mark.parametrize("command,action", VALUED, ids=[f"{c}{a.option_strings[-1]}" for c, a in VALUED])
def test_a_value_option_without_its_value_or_with_a_wrong_choice_is_one_line(capsys, command, action):
    flag = action.option_strings[-1]
    line = _refused([command, *REQUIRED[command], flag], capsys)
    assert line == f"neutrain: error: {command}: argument {flag}: expected one argument", line
    if action.choices:
        line = _refused([command, *REQUIRED[command], flag, "no-such-choice"], capsys)
        assert line.startswith(f"neutrain: error: {command}: argument {flag}: invalid choice: 'no-such-choice'"), line


def test_exclusive_options_and_leftover_arguments_are_one_line(capsys):
    line = _refused(["generate", "m", "--prompt", "a", "--input-file", "f"], capsys)
    assert line == "neutrain: error: generate: argument --input-file: not allowed with argument --prompt", line
    line = _refused(["export", "ckpt", "train.max_steps=3"], capsys)  # export takes no overrides
    assert line.startswith("neutrain: error: export: unrecognized argument 'train.max_steps=3'"), line
    line = _refused(["--no-such-option"], capsys)
    assert line.startswith("neutrain: error: unknown option '--no-such-option'"), line


@pytest.mark.parametrize("command", ["train", "eval", "estimate", "distill"])
def test_a_double_dash_before_the_overrides_ends_the_options(command):
    from neutrain.cli.main import _parse, _parser

    parser, overrides = _parser(command), ["eval.max_eval_samples=2", "train.max_steps=3"]
    option = ["--recipe", "r.yaml"] if command == "eval" else []
    plain = _parse(parser, [command, *REQUIRED[command], *option, *overrides])
    dashed = _parse(parser, [command, *REQUIRED[command], *option, "--", *overrides])
    assert dashed.overrides == plain.overrides == overrides
