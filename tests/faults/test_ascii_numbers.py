"""A number is read only from ASCII digits: every numeric recipe key, ``memory.device_budget_gib`` and every
numeric or level ``NEUTRAIN_*`` variable refuses another script's digits (``'٣'``, ``'１２８'``) or an underscore
(``'1_0'``) in one line naming it, where Python's ``int()`` and ``float()`` took them for numbers."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neutrain.config.knobs import KNOBS
from neutrain.config.numbers import parse_number
from neutrain.config.schema import SCHEMA
from tests.faults.test_recipe_ranges import NUMERIC, NUMERIC_KNOBS, _cli, _one_line_naming, _recipe

# Zero of some scripts whose digits Python's int() reads: Arabic-Indic, extended Arabic-Indic, Devanagari,
# Bengali, Thai, full-width, mathematical bold.
ZEROS = [0x660, 0x6F0, 0x966, 0x9E6, 0xE50, 0xFF10, 0x1D7CE]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


def _foreign(text: str, zero: int, which: int) -> str:
    """``text`` with its ``which``-th ASCII digit (counted modulo their number) written in the script of ``zero``."""
    places = [i for i, c in enumerate(text) if c.isdigit()]
    i = places[which % len(places)]
    return text[:i] + chr(zero + int(text[i])) + text[i + 1:]


def _disguised(number: str) -> st.SearchStrategy:
    """``number`` with one digit from another script, or an underscore between two digits."""
    places = [i for i in range(1, len(number)) if number[i - 1].isdigit() and number[i].isdigit()]
    options = [st.builds(_foreign, st.just(number), st.sampled_from(ZEROS), st.integers(0, 20))]
    if places:
        options.append(st.sampled_from(places).map(lambda i: number[:i] + "_" + number[i:]))
    return st.one_of(options)


@SETTINGS
@given(value=st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=False, allow_infinity=False)))
def test_ascii_numbers_read_as_python_reads_them(value):
    text = repr(value)
    assert parse_number(text) == float(text)
    if isinstance(value, int):
        assert parse_number(text, integer=True) == value
    assert parse_number(f"  {text} ") == float(text)


@SETTINGS
@given(data=st.data(), value=st.one_of(st.integers(0, 10**6), st.floats(0, 1e6)))
def test_no_other_digits_or_underscores_read_as_numbers(data, value):
    text = data.draw(_disguised(repr(value)))
    assert parse_number(text) is None and parse_number(text, integer=True) is None


@SETTINGS
@given(data=st.data(), key=st.sampled_from(NUMERIC + [("memory", "device_budget_gib")]))
def test_a_recipe_number_in_other_digits_is_one_line_naming_its_key(tmp_path_factory, data, key):
    section, name = key
    text = data.draw(_disguised("12"), label="value")
    path = _recipe(tmp_path_factory.mktemp("r"), section, name, text)
    _one_line_naming(*_cli(["estimate", str(path)]), f"{section}.{name}")


@SETTINGS
@given(data=st.data(), name=st.sampled_from(NUMERIC_KNOBS + sorted(k for k, v in KNOBS.items() if v.type == "level")))
def test_an_environment_number_in_other_digits_is_one_line_naming_it(monkeypatch, data, name):
    knob = KNOBS[name]
    low = knob.gt if knob.gt is not None else knob.min if knob.min is not None else 0
    inside = max(1, math.ceil(low) + 1) if knob.max is None else min(max(1, math.ceil(low) + 1), int(knob.max))
    monkeypatch.setenv(name, data.draw(_disguised(str(inside)), label="text"))
    try:
        _one_line_naming(*_cli(["recipes"]), f"environment variable {name}=")
    finally:
        monkeypatch.delenv(name)
