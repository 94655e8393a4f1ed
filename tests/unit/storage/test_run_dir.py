"""The run directory is held by its identity, and only what the run listed is deleted: generated layouts.

Before: the run re-resolved ``train.output_dir`` at every write, so a symlink re-pointed during the run sent
its later writes (and rotation's deletions) into another folder; an overwrite deleted names by what the
folder held, not by what the run wrote.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neutrain.storage.run_dir import (IDENTITY, clear_owned, close_run, held, open_run, read_ledger, rotate_owned,
                                      write_identity)
from neutrain.storage.run_lock import RunDirectoryError
from neutrain.trainer.ownership import note_resolved

_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _tree(root: Path) -> dict[str, bytes | str]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else "dir")
            for p in sorted(root.rglob("*")) if not p.is_symlink()}


@pytest.mark.slow
@_SETTINGS
@given(chain=st.integers(0, 3), parent_link=st.booleans(), repoint=st.integers(0, 3))
def test_a_run_writes_where_its_directory_led_at_the_start_whatever_links_are_re_pointed(tmp_path_factory, chain,
                                                                                         parent_link, repoint):
    base = tmp_path_factory.mktemp("layout")
    real, other = base / "real", base / "other"
    (real / "run").mkdir(parents=True)
    (other / "run" / "checkpoint-1").mkdir(parents=True)
    (other / "run" / "checkpoint-1" / "notes.txt").write_text("the user's")
    # A chain of `chain` links to the run directory, or to its parent (then the run is <link>/run).
    target = real if parent_link else real / "run"
    links = []
    for i in range(chain):
        link = base / f"link{i}"
        link.symlink_to(links[-1] if links else target)
        links.append(link)
    given_path = (links[-1] if links else target)
    given_path = given_path / "run" if parent_link else given_path
    resolved = note_resolved("train.output_dir", str(given_path))
    run = open_run(resolved, {"train": {}})
    try:
        before = _tree(other)
        # Every link is re-pointed at the other folder while the run goes on.
        for link in links[: repoint + 1]:
            link.unlink()
            link.symlink_to(other if parent_link else other / "run")
        for name in ("metrics.jsonl", "checkpoint-2", "checkpoint-3"):
            path = Path(resolved) / name
            run.claim(name)
            path.mkdir() if name.startswith("checkpoint") else path.write_text("x")
        rotate_owned(run, 1)
        assert _tree(other) == before  # nothing written or deleted there
        assert sorted(os.listdir(real / "run")) == sorted([IDENTITY, "checkpoint-3", "metrics.jsonl"])
        # The real directory itself replaced (moved away, another made in its place): refused, never followed.
        os.rename(real / "run", real / "moved")
        (real / "run").mkdir()
        with pytest.raises(RunDirectoryError, match="no longer the directory this run started in"):
            run.claim("summary.json")
        with pytest.raises(RunDirectoryError):
            rotate_owned(run, 1)
    finally:
        close_run(resolved)


@_SETTINGS
@given(names=st.lists(st.sampled_from(["recipe.yaml", "eval", "distill", "notes", "tokenizer", "metrics.jsonl",
                                       "export", "checkpoint-1", "summary.json", "data.csv"]),
                      min_size=1, max_size=6, unique=True),
       wrote=st.sets(st.sampled_from(["metrics.jsonl", "checkpoint-2", "summary.json", "tokenizer", "eval"]), max_size=5))
def test_an_overwrite_deletes_only_what_the_run_listed_and_claims_refuse_the_rest(tmp_path_factory, names, wrote):
    root = tmp_path_factory.mktemp("run")
    write_identity(root, {"train": {}})
    run = open_run(root)
    try:
        for name in sorted(wrote):  # what the run wrote
            run.claim(name)
            (root / name).mkdir() if name in ("checkpoint-2", "tokenizer", "eval") else (root / name).write_text("run")
            if name == "checkpoint-2":
                (root / name / "trainer_state.json").write_text("{}")
        user = [n for n in names if n not in wrote]
        for name in user:  # the user's, put there afterwards
            (root / name).mkdir() if "." not in name or name.startswith("checkpoint") else (root / name).write_text("mine")
        for name in user:
            with pytest.raises(RunDirectoryError, match="this run did not write it"):
                run.claim(name)
        kept = {n: _tree(root / n) if (root / n).is_dir() else (root / n).read_bytes() for n in user}
        clear_owned(root, read_ledger(root))
        assert sorted(os.listdir(root)) == sorted([IDENTITY, *user])
        assert {n: _tree(root / n) if (root / n).is_dir() else (root / n).read_bytes() for n in user} == kept
    finally:
        close_run(root)


def test_an_unmarked_directory_with_files_is_held_by_no_run(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    assert open_run(tmp_path, {}) is None and not (tmp_path / IDENTITY).exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert open_run(empty, {}) is not None and held(empty / "metrics.jsonl")[1] == "metrics.jsonl"
    close_run(empty)
    assert held(empty / "metrics.jsonl") is None
    shutil.rmtree(empty)
