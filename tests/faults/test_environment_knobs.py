"""Every ``NEUTRAIN_*`` environment variable is read through one validated reader, with a type and a range.

``NEUTRAIN_KEEP_DECODED_MIB=inf`` (or ``nan``, ``1e400``) ended in a raw ``OverflowError``;
``NEUTRAIN_STOP_GRACE_S=1e12`` was taken at start and raised ``OverflowError: timestamp out of range`` in the
middle of the save a SIGTERM asked for. Each variable is now declared once (``neutrain.config.knobs.KNOBS``)
and checked when a command starts: a bad value is one line naming the variable, exit 2. The declaration is
the only way in: a scan of the package finds no other reader of a ``NEUTRAIN_*`` variable.
"""

from __future__ import annotations

import ast
import math
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neutrain.cli import main

try:
    from neutrain.config.knobs import KNOBS, EnvironmentVariableError, check_environment, knob
except ImportError:  # a neutrain without the declared reader: the command-line and scan tests below still run
    KNOBS, EnvironmentVariableError, check_environment, knob = {}, Exception, None, None

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "neutrain"

# Values no declared variable takes, whatever its type (a path knob gets a path that does not exist).
BAD = ["inf", "nan", "-inf", "1e400", "-1", "banana", "1e12", "0x10", "2", "/nonexistent/x"]


def _valid(name: str, value) -> bool:
    """What the declaration allows, computed apart from the reader under test."""
    k = KNOBS[name]
    if value is None:
        return True
    if k.type is bool:
        return isinstance(value, bool)
    if k.type == "level":
        return isinstance(value, int) and 0 <= value <= 50
    if k.type == "path":
        return pathlib.Path(value).is_dir() if k.directory else pathlib.Path(value).is_file()
    if k.choices:
        return value in k.choices
    return (isinstance(value, (int, float)) and math.isfinite(value) and (k.min is None or value >= k.min)
            and (k.gt is None or value > k.gt) and (k.max is None or value <= k.max))


@pytest.mark.parametrize("name", sorted(KNOBS))
@pytest.mark.parametrize("raw", BAD)
def test_every_variable_refuses_what_its_declaration_does_not_allow_in_one_line(name, raw):
    try:
        value = knob(name, {name: raw})
    except EnvironmentVariableError as exc:
        text = str(exc)
        assert text.startswith(f"environment variable {name}={raw!r}: ") and "\n" not in text, text
        return
    assert _valid(name, value), (name, raw, value)  # "2" may be a log level: then it must be a valid one


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(KNOBS)), st.text(max_size=30))
def test_any_text_gives_a_declared_value_or_one_line_naming_the_variable(name, raw):
    try:
        value = knob(name, {name: raw})
    except EnvironmentVariableError as exc:
        assert str(exc).startswith(f"environment variable {name}=") and "\n" not in str(exc)
    else:
        assert _valid(name, value), (name, raw, value)


@pytest.mark.parametrize("name,raw", [
    ("NEUTRAIN_KEEP_DECODED_MIB", "inf"), ("NEUTRAIN_KEEP_DECODED_MIB", "nan"), ("NEUTRAIN_KEEP_DECODED_MIB", "1e400"),
    ("NEUTRAIN_STOP_GRACE_S", "1e12"), ("NEUTRAIN_STOP_GRACE_S", "0"), ("NEUTRAIN_DEBUG", "maybe"),
    ("NEUTRAIN_SAGE_DISPATCH", "fastest"), ("NEUTRAIN_CPU_CODEC", "gpu"), ("NEUTRAIN_RECIPES", "/dev/null"),
])
def test_a_command_with_a_bad_variable_stops_at_start_in_one_line(monkeypatch, capsys, name, raw):
    monkeypatch.setenv(name, raw)
    assert main(["recipes"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"neutrain: error: environment variable {name}={raw!r}: "), err


def test_a_misspelt_variable_is_named_with_the_one_meant():
    warnings = check_environment({"NEUTRAIN_STOP_GRACE": "30", "NEUTRAIN_GIT_COMMIT": "abc"})
    assert warnings == ["environment variable NEUTRAIN_STOP_GRACE is not one neutrain reads; did you mean "
                        "NEUTRAIN_STOP_GRACE_S?"]


def test_the_stop_grace_reaches_the_timer_only_within_what_a_timer_can_wait():
    import threading

    from neutrain.trainer.signals import grace_seconds

    assert KNOBS["NEUTRAIN_STOP_GRACE_S"].max <= threading.TIMEOUT_MAX
    assert grace_seconds() == KNOBS["NEUTRAIN_STOP_GRACE_S"].default


def _environment_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, name)`` of every ``os.environ.get("NEUTRAIN_...")``, ``os.environ["NEUTRAIN_..."]``,
    ``os.getenv("NEUTRAIN_...")`` and ``"NEUTRAIN_..." in os.environ`` in a module."""
    found = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = ast.unparse(node.func)
            if func in ("os.environ.get", "os.getenv", "environ.get", "os.environ.pop", "os.environ.setdefault"):
                name = node.args[0].value
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("os.environ", "environ") \
                and isinstance(node.slice, ast.Constant):
            name = node.slice.value
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) \
                and any("environ" in ast.unparse(c) for c in node.comparators):
            name = node.left.value
        if isinstance(name, str) and name.startswith("NEUTRAIN_"):
            found.append((node.lineno, name))
    return found


def test_the_package_reads_no_neutrain_variable_but_through_the_declared_reader():
    stray, undeclared = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        if path.name != "knobs.py":
            stray += [f"{path.relative_to(PACKAGE)}:{line} reads {name}" for line, name in _environment_reads(tree)]
        for node in ast.walk(tree):  # knob("NEUTRAIN_X") and constants naming a variable must be declared
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value.startswith("NEUTRAIN_") and node.value.replace("_", "").isalnum() \
                    and not node.value.endswith("_") \
                    and node.value.isupper() and node.value not in KNOBS:
                undeclared.append(f"{path.relative_to(PACKAGE)}:{node.lineno} names {node.value}")
    assert not stray, "NEUTRAIN_* read around neutrain.config.knobs:\n" + "\n".join(stray)
    assert not undeclared, "NEUTRAIN_* names not declared in KNOBS:\n" + "\n".join(undeclared)


def test_the_scan_sees_every_way_of_reading_a_variable():
    source = ('import os\nos.environ.get("NEUTRAIN_A")\nos.getenv("NEUTRAIN_B")\nos.environ["NEUTRAIN_C"]\n'
              '"NEUTRAIN_D" in os.environ\n')
    assert [name for _, name in _environment_reads(ast.parse(source))] == ["NEUTRAIN_A", "NEUTRAIN_B", "NEUTRAIN_C",
                                                                          "NEUTRAIN_D"]
