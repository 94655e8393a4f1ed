"""Runs the fault tests share: each made once per session and only read by the tests that use it.

Why: the same tiny finished run was trained by several modules that only read it (2-5 s each). (The two-process
run the distributed tests share: ``tests/integration/conftest.py``.)
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """A finished tiny run (``tests.helpers.finished_run``: 2 steps, ``checkpoint-2``, an hf ``export``, no held-out
    evaluation), its recipe at ``<run>/../tiny.yaml``. Read only: a test that changes a run copies it."""
    from tests.helpers import finished_run

    return finished_run(tmp_path_factory.mktemp("tiny-run"), train={"max_steps": 2, "save_steps": 2},
                        eval={"perplexity": False})
