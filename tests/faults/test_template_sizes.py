"""A chat template cannot size a value past the bound in one step: filters, ``%`` and ``str.format`` included.

``'x'|center(10**9)``, ``'%1000000000s' % x``, ``'%1000000000s'|format(x)`` and ``'{:>1000000000}'.format(x)``
each build a gigabyte inside one C call, where no check made after a step can stop it: the probe took 40 s and
4 GB before its output bound refused it, and a width of ``10**12`` failed the probe with a MemoryError, so the
template was accepted and every row's rendering failed. Every filter, the ``%`` operator and every call now
have their sizes (integer arguments, widths and precisions in a format string) checked before they run, the
rule ``*`` and calls already had. Each case below is refused naming the size, before it is built, on the probe
and on a prompt that gates it on its content.
"""

from __future__ import annotations

import pytest

from neutrain.data import byte_tokenizer
from neutrain.data.template_bounds import TemplateCostError, bounded_rendering, check_template_bounds
from neutrain.errors import RecipeError

BIG = "100000000"  # 10**8: over the bound (2**20), small enough that the unbounded old way only takes seconds
SIZING = {
    "center filter": "{{ 'x'|center(%s) }}" % BIG,
    "indent filter": "{{ 'a\\nb'|indent(%s) }}" % BIG,
    "truncate filter": "{{ m|truncate(%s) }}" % BIG,
    "wordwrap filter": "{{ m|wordwrap(%s) }}" % BIG,
    "format filter width": "{{ '%%%ss'|format(m) }}" % BIG,
    "format filter precision": "{{ '%%.%sf'|format(1.5) }}" % BIG,
    "percent operator": "{{ '%%%ss' %% m }}" % BIG,
    "percent star width": "{{ '%%*s' %% (%s, m) }}" % BIG,
    "str.format width": "{{ '{:>%s}'.format(m) }}" % BIG,
    "str.format nested width": "{{ '{:>{w}}'.format(m, w=%s) }}" % BIG,
    "a filter through map": "{{ ['x']|map('center', %s)|list }}" % BIG,
}


def _tokenizer(body: str):
    tok = byte_tokenizer()
    tok.chat_template = ("{% set m = messages[0]['content'] %}" + body +
                         "{% for x in messages %}{{ x['content'] }}{% endfor %}")
    return tok


@pytest.mark.parametrize("case", SIZING)
def test_the_probe_refuses_a_size_past_the_bound_before_building_it(case):
    with pytest.raises(RecipeError, match=r"(size|format width) over 1,048,576"):
        check_template_bounds(_tokenizer(SIZING[case]))


@pytest.mark.parametrize("case", SIZING)
def test_a_prompt_that_opens_the_sizing_branch_is_refused_too(case):
    tok = _tokenizer("{% if 'boom' in m %}" + SIZING[case] + "{% endif %}")
    check_template_bounds(tok)  # the probe never opens the branch
    with pytest.raises(TemplateCostError, match=r"(size|format width) over 1,048,576"), bounded_rendering():
        tok.apply_chat_template([{"role": "user", "content": "boom"}], tokenize=False)


@pytest.mark.parametrize("ordinary", ["{{ 'x'|center(80) }}", "{{ '%5.2f'|format(1.5) }}", "{{ '%-8s|' % m }}",
                                      "{{ '{:>8}'.format(m) }}", "{{ 'year 1000000000' }}", "{{ m|truncate(255) }}"])
def test_ordinary_sizes_still_render(ordinary):
    tok = _tokenizer(ordinary)
    check_template_bounds(tok)
    with bounded_rendering():
        assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
