"""A file a manifest lists that is a FIFO, a directory or a socket is named as what it is, not as missing.

Before: ``generate``, ``eval`` and ``export`` said "checkpoint file '.../config.json' is missing" for a FIFO or
a directory standing at a listed name, sending the user to look for a file that is there; and a listed file
the caller may do without (``may_be_missing``) was skipped when a FIFO stood in its place instead of refused.
Every listed file of a checkpoint and of an export goes through the one manifest check.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest

from neutrain.errors import CheckpointError
from neutrain.storage.manifest import MANIFEST, verify_checkpoint
from tests.helpers import finished_run


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return finished_run(tmp_path_factory.mktemp("run"), train={"max_steps": 2, "save_steps": 2},
                        eval={"perplexity": False}, export={"format": "hf"})


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _socket(path: Path) -> None:
    sock, cwd = socket.socket(socket.AF_UNIX), os.getcwd()
    os.chdir(path.parent)  # bound by its short name: a socket's path has a short limit
    try:
        sock.bind(path.name)
    finally:
        os.chdir(cwd)
        sock.close()


KINDS = {"a FIFO (named pipe)": _fifo, "a directory": os.mkdir, "a socket": _socket}


def _listed(folder: str) -> list[str]:
    return ["config.json", "model.safetensors", "tokenizer.json"] + (
        ["trainer_state.json", "optimizer.pt"] if folder.startswith("checkpoint") else ["neutrain_export.json"])


@pytest.mark.parametrize("folder", ["checkpoint-2", "export"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_listed_file_replaced_by_another_kind_is_named_by_its_kind(run, tmp_path, folder, kind):
    for name in _listed(folder):
        copy = tmp_path / f"{folder}-{name}"
        shutil.copytree(run / folder, copy)
        (copy / name).unlink()
        KINDS[kind](copy / name)
        with pytest.raises(CheckpointError) as caught:
            verify_checkpoint(copy, may_be_missing=(name,))  # one the caller may do without must still be absent
        assert f"'{copy / name}' is {kind}, not a regular file" in str(caught.value), str(caught.value)
        assert "missing" not in str(caught.value)


def test_a_listed_file_that_is_absent_is_still_missing(run, tmp_path):
    copy = tmp_path / "checkpoint"
    shutil.copytree(run / "checkpoint-2", copy)
    (copy / "optimizer.pt").unlink()
    verify_checkpoint(copy, may_be_missing=("optimizer.pt",))
    with pytest.raises(CheckpointError, match=rf"optimizer.pt' is missing \(listed in {MANIFEST}\)"):
        verify_checkpoint(copy)
