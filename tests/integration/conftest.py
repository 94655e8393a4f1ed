"""Runs the integration tests share: each made once per session and only read by the tests that use it.

Why: a 2-process launch costs ~9 s on a 2-core machine (two interpreters importing torch and transformers); the
same replicated run serves the distributed checkpoint-trust tests (its files read, planted with pickles in a copy)
and the process-group teardown test (its stderr and the ranks' reports read), launched once.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def replicated_run(tmp_path_factory):
    """``(recipe, result, report_dir)`` of one 2-step, 2-process replicated run (AdaLomo, gloo on CPU) through
    ``tests.faults.train_then_report``: its ``out/checkpoint-2``, and ``report_dir/rank<r>.json``."""
    from tests.faults.test_checkpoint_trust import _recipe
    from tests.helpers import free_port
    from tests.integration.test_launch import _run

    directory = tmp_path_factory.mktemp("replicated")
    recipe = _recipe(directory, "replicated")
    result = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                   str(free_port()), "-m", "tests.faults.train_then_report", recipe, directory])
    return recipe, result, Path(directory)
