"""A run touches only what it wrote: its directory held from the start, no writes into a folder that is not empty
or its own, none inside another run's checkpoint or export, one writer per export directory, and a relaunch
of the same run recognised as that run.

Before: a symlinked ``train.output_dir`` re-pointed mid-run sent the later checkpoints, the export and the
metrics into the other folder, and rotation deleted that folder's ``checkpoint-1``; a first run replaced a
user's ``recipe.yaml`` and ``tokenizer/`` and appended to their ``metrics.jsonl``; an overwrite deleted a
user's ``eval/`` and ``distill/`` from a folder no run had used; ``train.output_dir=RUN/checkpoint-2``
wrote a run inside a checkpoint; two runs sharing ``export.output_dir`` both exported; a relaunch of the
finished quick start said its directory held "another run's checkpoints". In-process unless a second live
process is the point.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neutrain.cli import main as neutrain
from neutrain.storage.manifest import MANIFEST, verify_checkpoint
from tests.helpers import child_env, finished_run, one_error_line, write_recipe

REPO = Path(__file__).resolve().parents[2]
QUIET = {"eval": {"perplexity": False}, "export": {"format": "none"}}


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): (p.read_text(errors="replace") if p.is_file() else "dir")
            for p in sorted(root.rglob("*")) if not p.name.startswith(".neutrain")}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished tiny run with a checkpoint and an export (its recipe beside it)."""
    return finished_run(tmp_path_factory.mktemp("owned"), train={"max_steps": 2, "save_steps": 2},
                        eval={"perplexity": False}, export={"format": "hf"})


def test_a_symlinked_output_dir_re_pointed_during_the_run_changes_nothing_where_it_now_points(tmp_path, monkeypatch):
    import neutrain.trainer.trainer as trainer_module

    real, other, link = tmp_path / "real", tmp_path / "other", tmp_path / "link"
    real.mkdir()
    (other / "checkpoint-1").mkdir(parents=True)
    (other / "checkpoint-1" / "notes.txt").write_text("the user's notes")
    (other / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    link.symlink_to(real)
    recipe = write_recipe(tmp_path, train={"output_dir": str(link), "max_steps": 3, "save_steps": 1,
                                           "save_total_limit": 1}, eval={"perplexity": False}, export={"format": "hf"})
    original = trainer_module.write_manifest

    def repoint_at_the_first_save(directory, *args, **kwargs):
        if os.path.realpath(link) == str(real):
            link.unlink()
            link.symlink_to(other)
        return original(directory, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "write_manifest", repoint_at_the_first_save)
    before = _tree(other)
    assert neutrain(["train", str(recipe)]) == 0
    assert _tree(other) == before  # no checkpoint, export or metrics went there; its checkpoint-1 is whole
    assert {"checkpoint-3", "export", "metrics.jsonl", "summary.json"} <= set(os.listdir(real))
    assert not (real / "checkpoint-1").exists()  # rotated: the run's own


USER_FILES = {
    "recipe-tokenizer-metrics": {"recipe.yaml": "# my commented recipe\ntrain: {}\n",
                                 "tokenizer/tokenizer.json": "{}", "metrics.jsonl": '{"step": 1, "loss": 9.0}\n'},
    "eval-distill": {"recipe.yaml": "# mine\n", "eval/results.json": "{}", "distill/notes.txt": "mine"},
    "a-foreign-checkpoint": {"checkpoint-1/trainer_state.json": '{"global_step": 1}', "checkpoint-1/notes.txt": "mine"},
    "notes": {"notes.txt": "mine"},
}
FLAGS = {"no-flag": [], "overwrite": ["train.overwrite_output_dir=true"], "resume": ["train.resume_from_checkpoint=true"]}


def _plant(out: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(text)


@pytest.mark.parametrize("flags", FLAGS)
@pytest.mark.parametrize("contents", USER_FILES)
def test_a_run_refuses_a_folder_that_is_neither_empty_nor_its_own(tmp_path, capsys, contents, flags):
    recipe = write_recipe(tmp_path, train={"max_steps": 1, "save_steps": 1}, **QUIET)
    out = tmp_path / "out"
    _plant(out, USER_FILES[contents])
    before = _tree(out)
    assert neutrain(["train", str(recipe), *FLAGS[flags]]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"train.output_dir '{out}'" in line and "nothing was written" in line, line
    assert _tree(out) == before


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(names=st.lists(st.sampled_from(["recipe.yaml", "tokenizer/vocab.json", "eval/x.json", "distill/a.txt",
                                       "export/config.json", "summary.json", "metrics.jsonl", "notes.md", "base/w.bin",
                                       "checkpoint-3/trainer_state.json", "training_curves.png", ".hidden"]),
                      min_size=1, max_size=5, unique=True),
       flags=st.sampled_from(list(FLAGS.values())))
def test_generated_folder_contents_are_never_written_over(tmp_path_factory, names, flags):
    base = tmp_path_factory.mktemp("generated")
    recipe = write_recipe(base, train={"max_steps": 1, "save_steps": 1}, **QUIET)
    _plant(base / "out", {name: f"user {name}" for name in names})
    before = _tree(base / "out")
    assert neutrain(["train", str(recipe), *flags]) == 2
    assert _tree(base / "out") == before


def test_a_relaunch_is_the_same_run_and_another_recipe_another_run(tmp_path, capsys):
    recipe = write_recipe(tmp_path, train={"max_steps": 2, "save_steps": 1, "save_total_limit": 3}, **QUIET)
    out = tmp_path / "out"
    assert neutrain(["train", str(recipe)]) == 0
    before = _tree(out)
    capsys.readouterr()
    assert neutrain(["train", str(recipe)]) == 0  # the finished run, relaunched as it was launched
    said = capsys.readouterr()
    assert "run already finished" in said.out and "another run" not in said.out + said.err
    assert _tree(out) == before
    shutil.rmtree(out / "checkpoint-2")  # as a run stopped after its first save leaves it
    (out / "summary.json").unlink()
    assert neutrain(["train", str(recipe)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "this run's checkpoints (the same recipe, stopped at step 1)" in line and "another" not in line, line
    assert "train.resume_from_checkpoint=true" in line
    assert neutrain(["train", str(recipe), "train.learning_rate=1e-3"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "another run's checkpoints (checkpoint-1)" in line and "train.learning_rate: 0.003 -> 0.001" in line, line


INSIDE = {  # command line -> the key the refusal names, and what the target lies in
    "train-in-checkpoint": (["train", "{recipe}", "train.output_dir={run}/checkpoint-2"], "train.output_dir", "checkpoint"),
    "train-below-checkpoint": (["train", "{recipe}", "train.output_dir={run}/checkpoint-2/sub"], "train.output_dir",
                               "checkpoint"),
    "train-in-export": (["train", "{recipe}", "train.output_dir={run}/export"], "train.output_dir", "export"),
    "export-dir-in-checkpoint": (["train", "{recipe}", "train.output_dir={tmp}/new", "export.format=hf",
                                  "export.output_dir={run}/checkpoint-2/hf"], "export.output_dir", "checkpoint"),
    "export-dir-in-export": (["train", "{recipe}", "train.output_dir={tmp}/new2", "export.format=hf",
                              "export.output_dir={run}/export/hf"], "export.output_dir", "export"),
    "eval-outputs-in-checkpoint": (["eval", "{run}/checkpoint-2", "train.output_dir={run}/checkpoint-2",
                                    "--recipe", "{recipe}"], "train.output_dir", "checkpoint"),
    "export-output-in-checkpoint": (["export", "{run}/checkpoint-2", "--output", "{run}/checkpoint-2/hf"], "--output",
                                    "checkpoint"),
    "export-output-in-export": (["export", "{run}/checkpoint-2", "--output", "{run}/export/hf"], "--output", "export"),
    "distill-in-export": (["distill", "{recipe}", "train.output_dir={run}/export"], "train.output_dir", "export"),
}


@pytest.mark.parametrize("case", INSIDE)
def test_no_output_lies_inside_another_runs_checkpoint_or_export(run, tmp_path, capsys, case):
    argv, key, what = INSIDE[case]
    recipe = run.parent / "tiny.yaml"
    before = _tree(run)
    args = [a.format(recipe=recipe, run=run, tmp=tmp_path) for a in argv]
    assert neutrain(args) == 2
    line = one_error_line(capsys.readouterr().err)
    assert key in line and f"lies inside the {what}" in line, line
    assert _tree(run) == before
    verify_checkpoint(run / "checkpoint-2")
    verify_checkpoint(run / "export")




_HOLDER = ("import sys, time\n"
           "from neutrain.storage.run_lock import ExportLock\n"
           "ExportLock(sys.argv[1]).acquire()\n"
           "print('held', flush=True)\n"
           "time.sleep(300)\n")


def test_an_export_directory_is_written_by_one_run_at_a_time_and_names_its_run(tmp_path, capsys):
    shared = tmp_path / "shared-export"
    recipe = write_recipe(tmp_path / "a", train={"max_steps": 2, "save_steps": 2}, eval={"perplexity": False},
                          export={"format": "hf", "output_dir": str(shared)})
    # Another run holding the export directory (its lock, taken as a run takes it at its start).
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(shared)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        assert holder.stdout.readline().strip() == "held", holder.communicate()[1][-2000:]
        assert neutrain(["train", str(recipe)]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert f"export.output_dir '{shared}' is in use by another neutrain run (pid {holder.pid}" in line, line
        assert not (tmp_path / "a" / "out" / "checkpoint-2").exists()  # refused before it trained
    finally:
        holder.kill()
        holder.wait()
    capsys.readouterr()
    assert neutrain(["train", str(recipe)]) == 0  # the holder is dead: its lock is taken over
    info = json.loads((shared / "neutrain_export.json").read_text())
    checkpoint = tmp_path / "a" / "out" / "checkpoint-2"
    content = hashlib.sha256((checkpoint / MANIFEST).read_bytes()).hexdigest()  # every file's sha256, hashed
    assert info["checkpoint"] == str(checkpoint) and info["checkpoint_sha256"] == content
    ledger = (tmp_path / "a" / "out" / ".neutrain-run").read_text().splitlines()[0]
    assert info["run"] == {"output_dir": str(checkpoint.parent), "id": json.loads(ledger)["run"]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "shared-export"]  # no lock file left behind
