"""A pytest plugin for ``--collect-only``: prints how many tests the suite and its quick subset hold.

Used by ``tests/test_readme_counts.py`` (``python -m pytest --collect-only -q -p tests.collect_counts tests``):
one collection gives both counts. The quick subset is the README's
``python -m pytest -q -m "not slow and not distributed" tests/unit``.

A session that collected the whole suite itself (``python -m pytest`` over ``tests/``, nothing deselected or
ignored: CI's run) already holds both counts: ``tests/conftest.py`` records them in ``SESSION`` through
:func:`record_session`, and the README test reads them there instead of collecting the suite again in a
second interpreter (a collection of ~4,300 tests: 10-15 s on 2 CPU cores).
"""

from __future__ import annotations

import json
from pathlib import Path

TESTS = Path(__file__).resolve().parent
UNIT = TESTS / "unit"
SESSION: dict = {}
"""``{"counts": {...}}`` once this session's collection is known to be the whole suite; ``{"partial": True}`` when
something was deselected (``-k``, ``-m``, ``--deselect``, ``--lf``): its items are then not the suite."""


def counts(items) -> dict[str, int]:
    """``{"suite": N, "quick": M}`` of collected ``items``."""
    quick = [item for item in items
             if UNIT in Path(str(item.path)).parents
             and not any(item.get_closest_marker(name) for name in ("slow", "distributed"))]
    return {"suite": len(items), "quick": len(quick)}


def whole_suite(session) -> bool:
    """Whether ``session`` collected exactly the suite: every argument is the ``tests`` folder, nothing ignored,
    deselected or failed to collect."""
    config = session.config
    base = Path(config.invocation_params.dir)
    args = [str(arg) for arg in config.args]
    return bool(args) and all("::" not in arg and (base / arg).resolve() == TESTS for arg in args) \
        and not config.getoption("ignore", None) and not config.getoption("ignore_glob", None) \
        and not SESSION.get("partial") and session.testsfailed == 0


def record_session(session) -> None:
    if whole_suite(session):
        SESSION["counts"] = counts(session.items)


def pytest_collection_finish(session) -> None:
    print("neutrain-test-counts " + json.dumps(counts(session.items)))
