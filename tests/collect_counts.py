"""A pytest plugin for ``--collect-only``: prints how many tests the suite and its quick subset hold.

Used by ``tests/test_readme_counts.py`` (``python -m pytest --collect-only -q -p tests.collect_counts tests``):
one collection gives both counts. The quick subset is the README's
``python -m pytest -q -m "not slow and not distributed" tests/unit``.
"""

from __future__ import annotations

import json
from pathlib import Path

UNIT = Path(__file__).resolve().parent / "unit"


def pytest_collection_finish(session) -> None:
    quick = [item for item in session.items
             if UNIT in Path(str(item.path)).parents
             and not any(item.get_closest_marker(name) for name in ("slow", "distributed"))]
    print("neutrain-test-counts " + json.dumps({"suite": len(session.items), "quick": len(quick)}))
