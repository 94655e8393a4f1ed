"""Checkpoint trust for FSDP2's and ZeRO-3's per-rank checkpoints: a pickle planted in any of their files is
refused by the verifier and by a real two-process resume, and runs nothing.

The same tests as ``tests/faults/test_checkpoint_trust.py`` (which covers the single-process modes and the
replicated one); each checkpoint here is a two-process launch (DeepSpeed's import alone takes seconds), so they
run with the other real launches.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.faults.test_checkpoint_trust import checkpoint_of  # noqa: F401  (the fixture, made once per module)
from tests.faults.test_checkpoint_trust import (
    test_every_file_of_a_checkpoint_refuses_a_planted_pickle as _every_file_refuses_a_planted_pickle,
    test_resume_from_a_planted_pickle_exits_2_and_runs_nothing as _resume_from_a_planted_pickle,
)

NEEDS_DEEPSPEED = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
SHARDED = [pytest.param("fsdp2", marks=pytest.mark.distributed),
           pytest.param("deepspeed", marks=[pytest.mark.distributed, NEEDS_DEEPSPEED])]


@pytest.mark.parametrize("mode", SHARDED)
def test_every_file_of_a_sharded_checkpoint_refuses_a_planted_pickle(mode, checkpoint_of, tmp_path):  # noqa: F811
    _every_file_refuses_a_planted_pickle(mode, checkpoint_of, tmp_path)


@pytest.mark.parametrize("mode", SHARDED)
def test_resume_from_a_planted_pickle_in_a_sharded_checkpoint_exits_2_and_runs_nothing(mode, checkpoint_of,  # noqa: F811
                                                                                        tmp_path, capsys):
    _resume_from_a_planted_pickle(mode, checkpoint_of, tmp_path, capsys)
