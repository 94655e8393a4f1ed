"""Every docstring example in ``neutrain/`` runs, on CPU, as part of ``python -m pytest -q``.

Why a test module rather than ``--doctest-modules``: the README's command and
``testpaths = ["tests"]`` stay as they are, each docstring becomes its own test
id (``test_docstring_examples[neutrain.nn.lora]``), and the run can be checked for
side effects (an example must not leave files in the checkout). Examples that
need a GPU, a process group or minutes of training mark those lines
``# doctest: +SKIP`` with the reason on a comment line above.
"""

from __future__ import annotations

import contextlib
import doctest
import importlib
import io
import os
import pkgutil
from pathlib import Path

import pytest

import neutrain

ROOT = Path(__file__).resolve().parents[1]
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

# Docstrings whose examples still fail, in files that other branches of the
# renovation are rewriting. strict=True: once fixed there, the entry
# turns into a failure here and must be removed. The fixes are in the report of
# branch h/docs.
PENDING: dict[str, str] = {}
# Docstrings whose examples pass but are too slow for every test run.
SLOW: dict[str, str] = {}


def _module_names() -> list[str]:
    return ["neutrain"] + sorted(m.name for m in pkgutil.walk_packages(neutrain.__path__, "neutrain."))


def _docstring_tests() -> list[doctest.DocTest]:
    # Some optional dependencies print a banner on stdout when first imported
    # (DeepSpeed: "Setting accelerator to CPU"); import them here so that the
    # banner does not land inside whichever example happens to import them first.
    with contextlib.redirect_stdout(io.StringIO()):
        with contextlib.suppress(Exception):
            importlib.import_module("deepspeed")
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests = []
    for name in _module_names():
        module = importlib.import_module(name)
        # find() keeps only objects defined in this module, so re-exports are not run twice.
        tests += [t for t in finder.find(module, name) if t.examples]
    return sorted(tests, key=lambda t: t.name)


TESTS = _docstring_tests()


def _param(test: doctest.DocTest):
    marks = []
    if test.name in PENDING:
        marks.append(pytest.mark.xfail(strict=True, reason=PENDING[test.name]))
    if test.name in SLOW:
        marks.append(pytest.mark.skip(reason=SLOW[test.name]))
    return pytest.param(test, id=test.name, marks=marks)


def test_the_package_has_examples_and_the_lists_name_real_docstrings():
    # Guards against a finder that silently finds nothing, and against stale list entries.
    names = {t.name for t in TESTS}
    assert sum(len(t.examples) for t in TESTS) >= 200
    assert not (set(PENDING) | set(SLOW)) - names


@pytest.mark.parametrize("test", [_param(t) for t in TESTS])
def test_docstring_examples(test: doctest.DocTest, monkeypatch):
    # Examples may name shipped recipes by path, as a user in a checkout would.
    monkeypatch.chdir(ROOT)
    before = set(os.listdir(ROOT))
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report = io.StringIO()
    runner.run(test, out=report.write)
    assert runner.failures == 0, report.getvalue()
    assert set(os.listdir(ROOT)) == before, "an example left files in the checkout; use a temporary directory"
