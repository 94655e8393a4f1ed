"""One decision says which directory a run may write into: the refusals said before torch loads and the decision
taken under the run's lock are the same function's answer, over every folder state.

Before: ``refuse_used_directory`` (the early refusals) was a copy of ``take_directory``'s tree (an unmarked
folder, an earlier neutrain's run resumed, another run's checkpoints), free to drift from it. Here folder
states are generated (empty, the user's files, this run's identity, another run's checkpoints, an earlier
neutrain's layout, symlinks) and both paths run on copies of each.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neutrain.errors import UserInputError
from neutrain.storage.manifest import MANIFEST
from neutrain.storage.run_dir import write_identity
from neutrain.trainer.ownership import Verdict, decide, refuse_used_directory, take_directory

OURS, THEIRS = {"train": {"seed": 1}}, {"train": {"seed": 2}}

# What a folder may hold, each a way to put it there.
USER_FILES = ("notes.txt", "recipe.yaml", "tokenizer/vocab.json", "eval/results.json", "metrics.jsonl")


def _checkpoint(root: Path, step: int, marked: bool) -> str:
    path = root / f"checkpoint-{step}"
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"weights")
    if marked:  # written by a neutrain: it carries that neutrain's record of the run, and its manifest
        (path / "neutrain_run.json").write_text("{}")
        (path / MANIFEST).write_text(json.dumps({"format": "neutrain-manifest-1", "files": {}}))
    return path.name


folder_states = st.fixed_dictionaries({
    "user": st.lists(st.sampled_from(USER_FILES), unique=True, max_size=2),
    "identity": st.sampled_from([None, "ours", "theirs"]),  # a run marker, and with which recipe it started
    "checkpoints": st.lists(st.tuples(st.integers(1, 3), st.booleans(), st.booleans()), max_size=2,
                            unique_by=lambda c: c[0]),  # (step, carries a manifest, listed as the run's)
    "listed_outputs": st.booleans(),  # the run's ledger lists recipe.yaml and metrics.jsonl
    "symlink": st.sampled_from([None, "user-file", "checkpoint"]),
    # train.resume_from_checkpoint: off, true, a checkpoint of this folder, or one of another folder
    "resume": st.sampled_from([False, True, "inside", "elsewhere"]),
    "overwrite": st.booleans(),
})


def _build(root: Path, state: dict) -> None:
    root.mkdir()
    for name in state["user"]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("the user's")
    listed = [_checkpoint(root, step, marked) for step, marked, mine in state["checkpoints"] if mine]
    for step, marked, mine in state["checkpoints"]:
        if not mine:
            _checkpoint(root, step, marked)
    elsewhere = root.parent / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    if state["symlink"] == "user-file":
        (root / "link").symlink_to(elsewhere)
    elif state["symlink"] == "checkpoint":
        (root / "checkpoint-9").symlink_to(elsewhere)
    if state["identity"] is not None:
        wrote = listed + (["recipe.yaml", "metrics.jsonl"] if state["listed_outputs"] else [])
        write_identity(root, OURS if state["identity"] == "ours" else THEIRS, wrote)


def _resume(root: Path, resume: bool | str) -> bool | str:
    """``train.resume_from_checkpoint`` as the state names it, for the folder ``root``."""
    if resume == "inside":
        return str(root / "checkpoint-1")
    return str(root.parent / "elsewhere" / "checkpoint-2") if resume == "elsewhere" else resume


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): (os.readlink(p) if p.is_symlink() else p.read_text() if p.is_file() else "dir")
            for p in sorted(root.rglob("*"))}


def _outcome(call, root: Path) -> tuple[str, str] | None:
    """None, or the refusal's type and line, the folder holding ``root`` written as HERE (the copies lie apart)."""
    try:
        call()
    except UserInputError as refused:
        return type(refused).__name__, str(refused).replace(str(root.parent), "HERE")
    return None


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state=folder_states)
def test_the_early_refusals_and_the_decision_under_the_lock_agree_on_every_folder_state(state):
    with tempfile.TemporaryDirectory() as tmp:
        early, locked = Path(tmp, "a", "run"), Path(tmp, "b", "run")
        for root in (early, locked):
            root.parent.mkdir()
            _build(root, state)
        overwrite = state["overwrite"]
        resume, resumed = _resume(early, state["resume"]), _resume(locked, state["resume"])
        before = _tree(early)
        said_early = _outcome(lambda: refuse_used_directory(str(early), OURS, resume, overwrite), early)
        assert _tree(early) == before  # the early check writes nothing
        said_locked = _outcome(lambda: take_directory(str(locked), OURS, resumed, overwrite), locked)
        another = state["identity"] == "theirs" and any(mine for _, _, mine in state["checkpoints"])
        if another and state["resume"] == "elsewhere" and not overwrite:
            # another folder's checkpoint continued here would rotate away this run's and take its name
            assert said_early is not None and "holds another run's checkpoints" in said_early[1], (state, said_early)
        decision = _outcome(lambda: decide(str(early), OURS, resume, overwrite), early)
        if said_early is not None:  # refused early: refused alike under the lock, in the same words
            assert said_locked == said_early, state
            return
        assert decision is None  # no refusal raised by decide itself (a linked checkpoint is refused early)
        verdict = decide(str(early), OURS, resume, overwrite)
        assert verdict.refusal is None, (state, verdict)
        if said_locked is not None:  # what only the lock's side checks: the names this run will write over
            assert ("which the run there did not write" in said_locked[1]
                    or "was not written by the previous run" in said_locked[1]), (state, said_locked)


DECISIONS = {  # folder -> launch (resume, overwrite) -> the verdict
    "absent": (lambda root: None, (False, False), Verdict.NEW),
    "empty": (lambda root: root.mkdir(), (False, False), Verdict.NEW),
    "user-files": (lambda root: (root.mkdir(), (root / "notes.txt").write_text("x")), (False, True), Verdict.UNMARKED),
    "earlier-neutrain-resumed": (lambda root: (root.mkdir(), _checkpoint(root, 2, True)), (True, False),
                                 Verdict.TAKE_LEGACY),
    "earlier-neutrain-new-run": (lambda root: (root.mkdir(), _checkpoint(root, 2, True)), (False, False),
                                 Verdict.UNMARKED),
    "another-run": (lambda root: (root.mkdir(), _checkpoint(root, 2, True), write_identity(root, THEIRS, ["checkpoint-2"])),
                    (False, False), Verdict.ANOTHER_RUN),
    "this-run-relaunched": (lambda root: (root.mkdir(), _checkpoint(root, 2, True), write_identity(root, OURS, ["checkpoint-2"])),
                            (False, False), Verdict.SAME_RUN),
    "another-run-overwritten": (lambda root: (root.mkdir(), write_identity(root, THEIRS, [])), (False, True),
                                Verdict.OVERWRITE),
    "a-run-resumed": (lambda root: (root.mkdir(), write_identity(root, THEIRS, [])), (True, False), Verdict.CONTINUE),
    "unreadable-identity": (lambda root: (root.mkdir(), (root / ".neutrain-run").write_text("junk\n")), (False, False),
                            Verdict.UNREADABLE),
}


@pytest.mark.parametrize("case", DECISIONS)
def test_each_folder_state_has_one_typed_verdict_and_deciding_writes_nothing(tmp_path, case):
    make, (resume, overwrite), verdict = DECISIONS[case]
    root = tmp_path / "run"
    make(root)
    before = _tree(root) if root.exists() else None
    decision = decide(str(root), OURS, resume, overwrite)
    assert decision.verdict is verdict
    assert (decision.refusal is not None) == (verdict in (Verdict.UNMARKED, Verdict.ANOTHER_RUN, Verdict.UNREADABLE))
    assert (_tree(root) if root.exists() else None) == before
    with pytest.raises(Exception):  # frozen: a decision cannot be changed on its way from one caller to the other
        decision.verdict = Verdict.NEW


def test_another_folders_checkpoint_continued_into_a_run_is_refused_and_the_run_kept(tiny_run, tmp_path, capsys):
    from neutrain.cli import main
    from tests.helpers import one_error_line

    run, other = tmp_path / "run", tmp_path / "other" / "checkpoint-2"
    shutil.copytree(tiny_run, run, symlinks=True)
    shutil.copytree(tiny_run / "checkpoint-2", other)
    before = _bytes(run)
    # Another recipe (a learning rate a resume may change) continued from another folder's checkpoint, with a
    # rotation that would have deleted the run's own checkpoint-2.
    launch = ["train", str(tiny_run.parent / "tiny.yaml"), f"train.output_dir={run}", "train.learning_rate=0.001",
              f"train.resume_from_checkpoint={other}", "train.max_steps=4", "train.save_total_limit=1"]
    assert main(launch) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"holds another run's checkpoints (checkpoint-2), started with another recipe" in line, line
    assert f"continuing {other} there" in line, line
    assert _bytes(run) == before


def _bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
