"""A chat template's rendering costs in proportion to what it renders, not up to a constant per row.

Bounds that were constants (ten seconds, a million loop steps, a megabyte per value) let a template spend
them on every row: a macro recursing on the content, or a loop writing many values each under the value
bound, took seconds and megabytes on each row, hours over a data set, and a macro calling itself without end
ended in a ``RecursionError``. Each rendering is now held to its input's size (operations, output, macro
depth); the table below gates each hostile shape on a prompt's content, and the generated conversations
check that the named templates and an ordinary recursive one stay far inside the bounds.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neutrain.data import byte_tokenizer
from neutrain.data.chat import NAMED_TEMPLATES
from neutrain.data.template_bounds import TemplateCostError, bounded_rendering, check_template_bounds

_GATE = "{%% for m in messages %%}{%% if 'boom' in m['content'] %%}%s{%% endif %%}{{ m['content'] }}{%% endfor %%}"
HOSTILE = {
    # each value is under the value bound; together they are gigabytes
    "many values in a loop": (_GATE % "{% for i in range(900000) %}{{ 'ab' * 500000 }}{% endfor %}", "writes more than"),
    "many small values": (_GATE % "{% for i in range(900000) %}{{ m['role'] }}{% endfor %}", "writes more than"),
    "operations that write nothing": (_GATE % "{% for i in range(900000) %}{% set x = m['role'] %}{% endfor %}",
                                      "operations for an input of"),
    "fan-out recursion": ("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
                          + _GATE % "{{ f(22) }}", "operations for an input of"),
    "unending recursion": ("{% macro f(n) %}x{{ f(n + 1) }}{% endmacro %}" + _GATE % "{{ f(0) }}",
                           "calls its macros more than 64 deep"),
    "recursion through two macros": ("{% macro f(n) %}{{ g(n) }}{% endmacro %}{% macro g(n) %}y{{ f(n) }}{% endmacro %}"
                                     + _GATE % "{{ f(0) }}", "calls its macros more than 64 deep"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_template_is_held_to_its_input(name):
    template, said = HOSTILE[name]
    tok = byte_tokenizer()
    tok.chat_template = template
    check_template_bounds(tok)  # gated: the probe does not trip it
    with bounded_rendering():
        assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"
    started = time.monotonic()
    with pytest.raises(TemplateCostError, match=said), bounded_rendering():
        tok.apply_chat_template([{"role": "user", "content": "boom"}], tokenize=False)
    assert time.monotonic() - started < 3


_NESTED = ("{% macro show(v) %}{% if v is mapping %}{% for k, x in v.items() %}{{ k }}=({{ show(x) }}) {% endfor %}"
           "{% else %}{{ v }}{% endif %}{% endmacro %}"
           "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{{ show(tools or {}) }}")


def _nested(depth: int):
    value: dict = {"leaf": "x"}
    for i in range(depth):
        value = {f"k{i}": value, "type": "object"}
    return value


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["user", "assistant", "system"]), st.text(max_size=300)), max_size=60),
       st.sampled_from([*NAMED_TEMPLATES, "nested"]), st.integers(0, 20))
def test_ordinary_templates_stay_inside_the_bounds(turns, name, depth):
    tok = byte_tokenizer()
    tok.chat_template = _NESTED if name == "nested" else NAMED_TEMPLATES[name]
    messages = [{"role": role, "content": content} for role, content in turns]
    with bounded_rendering():
        tok.apply_chat_template(messages or [{"role": "user", "content": ""}], tokenize=False,
                                tools=[_nested(depth)] if name == "nested" else None)
