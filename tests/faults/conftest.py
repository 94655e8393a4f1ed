"""Runs the fault tests share: each made once per session and only read by the tests that use it.

Why: a 2-process launch costs ~9 s on a 2-core machine (two interpreters importing torch and transformers); the
same replicated run served ``test_checkpoint_trust``'s checkpoint (its files read, planted with pickles in a copy)
and ``test_run_lifecycle``'s process-group teardown (its stderr and the ranks' reports read), launched twice. The
same tiny finished run was trained by several modules that only read it (2-5 s each).
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


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """A finished tiny run (``tests.helpers.finished_run``: 2 steps, ``checkpoint-2``, an hf ``export``, no held-out
    evaluation), its recipe at ``<run>/../tiny.yaml``. Read only: a test that changes a run copies it."""
    from tests.helpers import finished_run

    return finished_run(tmp_path_factory.mktemp("tiny-run"), train={"max_steps": 2, "save_steps": 2},
                        eval={"perplexity": False})
