"""A run's life across relaunches and kills: finished runs stay untouched, longer runs continue exactly,
kills during a checkpoint save resume bit-exactly, and neutrain's own temporaries never pile up.

Cases: relaunching a finished run, leftover temporaries, and the
SIGKILL-during-save fault injection. Tiny CPU runs; trainings run in-process through
``neutrain.cli.main`` except the ones that are killed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from neutrain.config.sections import TrainSection
from neutrain.trainer.callbacks import read_metrics
from neutrain.cli import main as neutrain
from tests.helpers import child_env, write_recipe

REPO = Path(__file__).resolve().parents[2]
QUIET = {"export": {"format": "none"}, "eval": {"perplexity": False}}


def _recipe(directory: Path, **train) -> Path:
    return write_recipe(directory, train={"save_steps": 2, "save_total_limit": 2, **train}, **QUIET)


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` by relative path -> sha256, and every directory -> 'dir'."""
    tree = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        tree[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return tree


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


def _rates(out: Path) -> dict[int, float]:
    return {r["step"]: r["learning_rate"] for r in read_metrics(out / "metrics.jsonl") if "learning_rate" in r}


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "model.safetensors"))


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def _subprocess_env() -> dict[str, str]:
    return child_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", DISABLE_TQDM="1",
                     NEUTRAIN_LOG_LEVEL="WARNING")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ---- class 3: relaunching a finished run ---------------------------------------------------------------


def test_relaunching_a_finished_run_leaves_every_file_untouched(tmp_path, capsys):
    recipe = _recipe(tmp_path, max_steps=4, lr_scheduler="cosine", warmup_steps=0)
    out = tmp_path / "out"
    assert neutrain(["train", str(recipe)]) == 0
    before = _tree(out)
    assert "checkpoint-4/model.safetensors" in before and "summary.json" in before
    capsys.readouterr()
    for _ in range(2):  # each relaunch used to train one more step and rotate checkpoint-4 away
        assert neutrain(["train", str(recipe), "train.resume_from_checkpoint=true"]) == 0
        printed = capsys.readouterr().out
        assert "already finished" in printed and "checkpoint-4" in printed and "step 4" in printed, printed
        assert _tree(out) == before


def test_a_run_killed_while_replacing_its_final_checkpoint_is_restored_and_finished(tmp_path, capsys):
    """``.tmp-old-checkpoint-N`` holds the complete checkpoint while its replacement is renamed in."""
    recipe = _recipe(tmp_path, max_steps=4)
    out = tmp_path / "out"
    assert neutrain(["train", str(recipe)]) == 0
    final = _tree(out / "checkpoint-4")
    (out / "checkpoint-4").rename(out / ".tmp-old-checkpoint-4")  # killed between the two renames
    (out / ".tmp-checkpoint-4" / "checkpoint-4").mkdir(parents=True)
    (out / ".tmp-checkpoint-4" / "checkpoint-4" / "model.safetensors").write_bytes(b"\0" * 10)
    capsys.readouterr()
    assert neutrain(["train", str(recipe), "train.resume_from_checkpoint=true"]) == 0
    assert "already finished" in capsys.readouterr().out
    assert _tree(out / "checkpoint-4") == final
    assert not list(out.glob(".tmp-*"))


@pytest.mark.parametrize("schedule", ["constant_with_warmup", "linear"])
def test_raising_max_steps_continues_and_says_how_exactly(tmp_path, caplog, schedule):
    train = {"lr_scheduler": schedule, "warmup_steps": 1, "save_total_limit": 3}
    reference = _recipe(tmp_path / "reference", max_steps=6, **train)
    assert neutrain(["train", str(reference)]) == 0
    run = _recipe(tmp_path / "run", max_steps=4, **train)
    assert neutrain(["train", str(run)]) == 0
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="neutrain"):
        assert neutrain(["train", str(run), "train.max_steps=6", "train.resume_from_checkpoint=true"]) == 0
    log = caplog.text
    assert "train.max_steps changed from 4 (the checkpoint's run) to 6: continuing from step 4" in log, log
    ref_out, out = tmp_path / "reference" / "out", tmp_path / "run" / "out"
    assert sorted(_losses(out)) == list(range(1, 7))
    # Steps 5 and 6 use the 6-step schedule at their global step, as the uninterrupted run does.
    assert [_rates(out)[s] for s in (5, 6)] == [_rates(ref_out)[s] for s in (5, 6)]
    if schedule == "constant_with_warmup":  # independent of max_steps: the very same run
        assert "continues exactly as an uninterrupted 6-step run (same losses, same weights)" in log
        assert _losses(out) == _losses(ref_out)
        _assert_same_weights(out / "checkpoint-6", ref_out / "checkpoint-6")
    else:  # steps 1..4 decayed to zero over 4 steps: say so, with the learning rates at the seam
        assert "The linear schedule depends on max_steps" in log and "weights differ" in log
        assert f"learning rate {_rates(ref_out)[5]:.3g} at step 5" in log
        assert _losses(out)[5] != _losses(ref_out)[5]


def _checkpoint(out: Path, step: int, **state) -> Path:
    path = out / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step, **state}))
    return path


def _train(out: Path, **keys) -> TrainSection:
    return TrainSection(**{"output_dir": str(out), "resume_from_checkpoint": True, "max_steps": -1, "num_epochs": 1.0,
                           "lr_scheduler": "cosine", "warmup_steps": 0, "learning_rate": 1e-3, **keys})


def test_plan_resume_decides_finished_from_max_steps_or_epochs(tmp_path):
    from neutrain.errors import CheckpointError
    from neutrain.trainer.run_state import plan_resume

    assert plan_resume(_train(tmp_path / "none")).checkpoint is None  # nothing to resume yet: from scratch
    _checkpoint(tmp_path / "steps", 2, max_steps=4)
    last = _checkpoint(tmp_path / "steps", 4, max_steps=4)
    # Trained to the end, but no summary of it: only the phases after training are run again.
    unfinished = plan_resume(_train(tmp_path / "steps", max_steps=4))
    assert unfinished.after_training and not unfinished.finished and unfinished.checkpoint == str(last)
    (tmp_path / "steps" / "summary.json").write_text('{"steps": 4}')  # written after the last of them
    assert plan_resume(_train(tmp_path / "steps", max_steps=4)).finished
    assert plan_resume(_train(tmp_path / "steps", max_steps=3)).finished  # lowered below the checkpoint
    raised = plan_resume(_train(tmp_path / "steps", max_steps=8))
    assert not raised.finished and raised.checkpoint == str(last) and raised.step == 4
    # Epoch-based: finished once the saved epoch reaches num_epochs at the run's last step.
    _checkpoint(tmp_path / "epochs", 10, max_steps=10, epoch=1.0)
    (tmp_path / "epochs" / "summary.json").write_text('{"steps": 10}')
    assert plan_resume(_train(tmp_path / "epochs", num_epochs=1.0)).finished
    assert not plan_resume(_train(tmp_path / "epochs", num_epochs=1.5)).finished
    _checkpoint(tmp_path / "mid", 5, max_steps=10, epoch=0.5)
    assert not plan_resume(_train(tmp_path / "mid", num_epochs=1.0)).finished
    (last / "trainer_state.json").write_text('{"global_step": 4, "max_st')  # truncated
    with pytest.raises(CheckpointError, match=r"trainer_state\.json' is not valid JSON .*; resume from an earlier"):
        plan_resume(_train(tmp_path / "steps", max_steps=4))


# ---- class 13: leftover temporaries ------------------------------------------------------------------


def test_leftover_temporaries_are_removed_at_the_next_start_and_nothing_else(tmp_path, caplog):
    recipe = _recipe(tmp_path, max_steps=2)
    out = tmp_path / "out"
    dead, alive = _dead_pid(), os.getppid()
    leftovers = {  # the temporary name -> a file written under it
        ".tmp-checkpoint-8": ".tmp-checkpoint-8/checkpoint-8/optimizer.pt",  # killed mid-save
        ".tmp-old-checkpoint-2": ".tmp-old-checkpoint-2/model.safetensors",  # moved aside; checkpoint-2 is in place
        f"recipe.tmp{dead}": f"recipe.tmp{dead}",
        f"tokenizer.tmp{dead}": f"tokenizer.tmp{dead}/tokenizer.json",
        f".cache/python-stdlib-0123456789ab.tmp{dead}": f".cache/python-stdlib-0123456789ab.tmp{dead}",
    }
    assert neutrain(["train", str(recipe)]) == 0  # the run whose directory the temporaries are left in
    kept = {
        f"recipe.tmp{alive}": b"another live process writes this",
        ".tmp-notes": b"user file", "recipe.tmp": b"user file", "my.tmp-checkpoint-3": b"user file",
        ".tmp-checkpoint-2.bak/x": b"user file", ".tmp-checkpoint-x/x": b"user file", ".cache/notes.tmp1": b"user",
    }
    for rel, data in {**{f: b"partial" for f in leftovers.values()}, **kept}.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="neutrain"):  # checkpoint-2 is the run's: overwritten on request
        assert neutrain(["train", str(recipe), "train.overwrite_output_dir=true"]) == 0
    for name in leftovers:
        assert not (out / name).exists(), name
        assert f"removed {out / name} (temporary left by an interrupted or failed write)" in caplog.text
    for rel, data in kept.items():
        assert (out / rel).read_bytes() == data, rel


def test_export_cleans_up_after_a_failure_and_after_an_earlier_kill(tmp_path, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from neutrain.export import export_model
    from tests.helpers import TINY_LLAMA

    config = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}, vocab_size=64)
    model = LlamaForCausalLM(config)
    target = tmp_path / "export"
    export_model(model, target, "hf")
    previous = _tree(target)
    dead = _dead_pid()
    (tmp_path / f".tmp-export-{dead}").mkdir()  # an export killed while writing
    (tmp_path / f".tmp-export-{dead}" / "model.safetensors").write_bytes(b"half")

    def full_disk(self, path, *args, **kwargs):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(LlamaForCausalLM, "save_pretrained", full_disk)
    with pytest.raises(OSError, match="No space left"):
        export_model(model, target, "hf", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert _tree(target) == previous

    # Killed between moving the previous export aside and renaming the new one in: the previous one comes back.
    from neutrain.storage.leftovers import clean_export_leftovers

    target.rename(tmp_path / f".tmp-old-export-{dead}")
    (tmp_path / f".tmp-export-{dead}").mkdir()
    assert len(clean_export_leftovers(target)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert _tree(target) == previous


# ---- SIGKILL while a checkpoint is being saved, then resume ----------------------------------------------

KILL_STEPS = {"max_steps": 6, "save_steps": 2, "save_total_limit": 2, "lr_scheduler": "cosine", "warmup_steps": 1}
# Where the save of checkpoint-4 dies (tests/faults/kill_during_save.py): in the middle of writing the first file
# (model.safetensors, event 1) and a later one (optimizer.pt: also a kill between files), just before and just
# after the rename into place. A fixed list: a point drawn at random gave the suite another test each run (all
# six events of the save were run and pass; each costs a launch).
KILL_POINTS = ["event:1", "write:optimizer.pt", "rename", "renamed"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("uninterrupted")
    assert neutrain(["train", str(_recipe(directory, **KILL_STEPS))]) == 0
    return directory / "out"


@pytest.mark.parametrize("point", KILL_POINTS)
def test_sigkill_during_checkpoint_save_then_resume_is_bit_identical(tmp_path, uninterrupted, point):
    recipe = _recipe(tmp_path, **KILL_STEPS)
    out = tmp_path / "out"
    killed = subprocess.run([sys.executable, "-m", "tests.faults.kill_during_save", "4", point, "train", str(recipe)],
                            env=_subprocess_env(), capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, f"{point}: not killed (rc {killed.returncode}): {killed.stderr[-2000:]}"
    assert not (out / "checkpoint-6").exists()
    left = sorted(p.name for p in out.iterdir() if p.name.startswith(("checkpoint-", ".tmp-")))
    expected = ["checkpoint-2", "checkpoint-4"] if point == "renamed" else ["checkpoint-2"]
    assert [n for n in left if n.startswith("checkpoint-")] == expected, f"{point}: {left}"

    assert neutrain(["train", str(recipe), "train.resume_from_checkpoint=true"]) == 0
    assert _losses(out) == _losses(uninterrupted), f"{point}: losses differ after the resume ({left})"
    _assert_same_weights(out / "checkpoint-6", uninterrupted / "checkpoint-6")
    assert not list(out.glob(".tmp-*")), f"{point}: temporaries left after the resume"
