"""Checkpoint trust for two-process checkpoints (replicated, FSDP2's and ZeRO-3's per-rank files): a pickle planted
in any of their files is refused by the verifier and by a real two-process resume, and runs nothing; and the
replicated run tears its process group down before it exits.

The same tests as ``tests/faults/test_checkpoint_trust.py`` (which covers the single-process modes); each
checkpoint here is a two-process launch (DeepSpeed's import alone takes seconds), so they run with the other real
launches. The replicated checkpoint is the session's run (``tests/integration/conftest.py``).
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.faults.test_checkpoint_trust import checkpoint_of  # noqa: F401  (the fixture, made once per module)
from tests.faults.test_checkpoint_trust import (
    test_every_file_of_a_checkpoint_refuses_a_planted_pickle as _every_file_refuses_a_planted_pickle,
    test_resume_from_a_planted_pickle_exits_2_and_runs_nothing as _resume_from_a_planted_pickle,
)

NEEDS_DEEPSPEED = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
TWO_PROCESS = [pytest.param("replicated", marks=pytest.mark.distributed),
               pytest.param("fsdp2", marks=pytest.mark.distributed),
               pytest.param("deepspeed", marks=[pytest.mark.distributed, NEEDS_DEEPSPEED])]


@pytest.mark.parametrize("mode", TWO_PROCESS)
def test_every_file_of_a_two_process_checkpoint_refuses_a_planted_pickle(mode, checkpoint_of, tmp_path):  # noqa: F811
    _every_file_refuses_a_planted_pickle(mode, checkpoint_of, tmp_path)


@pytest.mark.parametrize("mode", TWO_PROCESS)
def test_resume_from_a_planted_pickle_in_a_two_process_checkpoint_exits_2_and_runs_nothing(mode, checkpoint_of,  # noqa: F811
                                                                                            tmp_path, capsys):
    _resume_from_a_planted_pickle(mode, checkpoint_of, tmp_path, capsys)


@pytest.mark.distributed
def test_two_process_run_destroys_its_process_group_before_exit(replicated_run):
    """Rank 1 aborted at exit now and then ("terminate called without an active exception"): gloo's worker threads
    met interpreter finalization. (The session's replicated run: 2 processes through train_from_recipe, each
    reporting at its end.)"""
    _, res, directory = replicated_run
    assert res.returncode == 0, res.stderr[-3000:]
    assert "terminate called" not in res.stderr
    for rank in (0, 1):
        assert json.loads((directory / f"rank{rank}.json").read_text()) == {"initialized": False}, rank
    summary = json.loads((directory / "out" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["distributed_mode"] == "replicated"
