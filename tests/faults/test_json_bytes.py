"""Any bytes at all in a JSON file neutrain keeps end in success or in one line naming the file.

The table of :mod:`tests.faults.test_json_reads` plants the faults someone thought of; here hypothesis writes
what nobody did: arbitrary bytes, arbitrary text in UTF-8, UTF-16 or UTF-32, and JSON values of every shape,
whole, cut short or with a byte changed, and the file's own content with one key set to such a value. Each is
written into each kept JSON file of the tiny checkpoint and driven through the same function the table calls.
The outcome is success or the project's :class:`~neutrain.errors.UserInputError` in one line; any other
exception fails the example. A file that is no JSON object is the reader's to refuse, and its line names the
file; a JSON object whose values do not fit is refused where the value is used, and that line names the key
or the tensor instead. Sizes are bounded, so no example can hang on its input.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from neutrain.errors import UserInputError
from tests.faults.test_json_reads import FILES, _copy, tiny_model  # noqa: F401  (tiny_model: the fixture)

_SCALARS = st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(max_size=20)
JSON_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=20)


@st.composite
def _damaged(draw, data: bytes) -> bytes:
    """``data`` whole, cut short, or with one byte changed."""
    how = draw(st.sampled_from(["whole", "cut", "byte"]))
    if how == "cut" or not data:
        return data[: draw(st.integers(0, len(data)))]
    if how == "byte":
        at = draw(st.integers(0, len(data) - 1))
        return data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1:]
    return data


def _json_text(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


@st.composite
def _own_content_with_a_key_set(draw, original: dict) -> bytes:
    """The file's real content with one key (existing or new) set to an arbitrary JSON value."""
    keys = sorted(original) + ["extra"]
    changed = dict(original, **{draw(st.sampled_from(keys)): draw(JSON_VALUES)})
    return draw(_damaged(_json_text(changed)))


def _contents(original: dict | None):
    text = st.text(max_size=200).flatmap(
        lambda t: st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "utf-32"]).map(t.encode))
    shapes = [st.binary(max_size=2048), text, JSON_VALUES.map(_json_text).flatmap(_damaged)]
    if original is not None:
        shapes.append(_own_content_with_a_key_set(original))
    return st.one_of(shapes)


@pytest.fixture(scope="module")
def prepared(tiny_model, tmp_path_factory) -> dict:
    """For each case of the table: the folder as its driver expects it, and the file's content there (or None)."""
    folders = {}
    for case, (name, _limit, _driver, prepare) in FILES.items():
        folder = _copy(tiny_model, tmp_path_factory.mktemp(case.replace("/", "-")))
        if prepare is not None:
            prepare(folder)
        path = folder / name
        folders[case] = folder, json.loads(path.read_text()) if path.is_file() else None
    return folders


def _one_case(prepared: dict, case: str, content: bytes) -> None:
    name, _limit, driver, _prepare = FILES[case]
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / prepared[case][0].name
        shutil.copytree(prepared[case][0], folder)
        (folder / name).write_bytes(content)
        try:
            driver(folder)
        except UserInputError as exc:  # any other exception fails the example as it is
            message = str(exc)
            assert "\n" not in message, message
            assert name in message or _an_object(content), message


def _an_object(content: bytes) -> bool:
    try:
        return isinstance(json.loads(content), dict)
    except ValueError:
        return False


@pytest.mark.parametrize("case", list(FILES))
def test_any_bytes_in_a_kept_json_file_are_taken_or_one_line_naming_it(prepared, case):
    @settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def check(data):
        _one_case(prepared, case, data.draw(_contents(prepared[case][1]), label=FILES[case][0]))

    check()
