"""Every numeric flag of every command goes through one parser: ASCII digits, finite, inside its range; else one
line naming the flag, exit 2.

Why: the flags were read with argparse's ``int``/``float``, which take what Python takes: ``--max-new-tokens ١٢``
(Arabic-Indic digits) was 12, ``--seed 1_0`` was 10, ``--temperature 1e30`` sampled from a flat distribution and
``--max-shard-size 0.0001KB`` wrote a file per tensor. The flags are found by walking each command's argparse
parser, so a flag added later is covered (or fails :func:`test_every_numeric_flag_is_declared_through_the_one_parser`).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from tests.helpers import one_error_line

PREFIX = {"generate": ["generate", "m", "--prompt", "x"], "chat": ["chat", "m"], "export": ["export", "m"]}
"""Each command's required arguments (the flag is refused before any is looked at)."""


def _flags() -> list[tuple[str, str, object]]:
    """``(command, flag, action)`` for every option of every command that takes a number."""
    from neutrain.cli.main import COMMANDS, _parser

    found = []
    for command in COMMANDS:
        parser = _parser(command)
        sub = next(a for a in parser._actions if a.dest == "command").choices[command]
        for action in sub._actions:
            default = action.default
            numeric = action.type in (int, float) or getattr(action.type, "number", None) is not None or (
                isinstance(default, (int, float)) and not isinstance(default, bool) and action.nargs != 0)
            if numeric and action.option_strings:
                found.append((command, action.option_strings[-1], action))
    return found


FLAGS = _flags()


def test_every_numeric_flag_is_declared_through_the_one_parser():
    from neutrain.config.numbers import numeric_type

    assert len(FLAGS) >= 15, FLAGS  # generate's 8, chat's 6 (sampling and device), export's --max-shard-size
    loose = [(command, flag) for command, flag, action in FLAGS if numeric_type(action) is None]
    assert not loose, f"declare these with neutrain.config.numbers.number_argument: {loose}"
    assert ("export", "--max-shard-size", ) in {(c, f) for c, f, _ in FLAGS}


def _bad_values(action) -> list[str]:
    from neutrain.config.numbers import numeric_type

    rule = numeric_type(action)
    if rule.kind == "size":
        return ["0KB", "0.5KB", "1B", "١GB", "5 GiB", "", "nan", "1e3KB", "2000TB", "-1MB"]
    above = rule.high * 10 + 1
    below = rule.low if rule.low_open else rule.low - 1
    words = ["nan", "inf", "-inf", "١٢", "1_0", "", "abc", "٣.٥", "1e400", "0x10", str(int(above))]
    words.append(str(int(below)) if rule.kind is int else repr(float(below)))
    if rule.kind is int:
        words += ["1.5", "1e3"]
    return words


CASES = [(command, flag, value) for command, flag, action in FLAGS for value in _bad_values(action)]


@pytest.mark.parametrize("command,flag,value", CASES, ids=[f"{c}{f}={v!r}" for c, f, v in CASES])
def test_a_bad_number_for_any_flag_is_one_line_naming_it_exit_2(capsys, command, flag, value):
    from neutrain.cli import main

    assert main([*PREFIX.get(command, [command]), f"{flag}={value}"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"neutrain: error: {flag}: "), line
    assert "usage:" not in capsys.readouterr().err


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([(flag, action) for _, flag, action in FLAGS]),
       st.one_of(st.text(max_size=8), st.floats().map(repr), st.integers(-2**70, 2**70).map(str),
                 st.text(alphabet="0123456789.eE+-_ ١٢٣٠KMGTB", max_size=8)))
def test_a_generated_text_is_parsed_in_range_or_refused_naming_the_flag(flag_action, text):
    from neutrain.config.numbers import FlagError, numeric_type

    flag, action = flag_action
    rule = numeric_type(action)
    try:
        value = action.type(text)
    except FlagError as exc:
        assert str(exc).startswith(f"{flag}: ") and "\n" not in str(exc)
        return
    assert text.strip().isascii() and text.strip()
    if rule.kind == "size":
        return
    assert math.isfinite(value) and value <= rule.high and (value > rule.low if rule.low_open else value >= rule.low)
    assert value == (int(text) if rule.kind is int else float(text))
