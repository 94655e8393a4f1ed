"""Exports never destroy what they would replace, and
non-finite steps are skipped, logged, counted, and stop the run when they persist.

Everything runs in-process on tiny models: `neutrain.cli.main` for the command line, `NeuTrainer`
directly where a step must be inspected.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from neutrain.trainer.callbacks import read_metrics
from tests.helpers import TINY_LLAMA, one_error_line, write_recipe

NAN = float("nan")


# ---------------------------------------------------------------- helpers


def _tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}, vocab_size=64)
    return LlamaForCausalLM(config)


def _fake_run(root: Path) -> Path:
    """A run directory as training leaves it: two checkpoints (different weights), metrics, recipe, summary."""
    run = root / "run"
    for step, seed in ((2, 1), (4, 2)):
        ckpt = run / f"checkpoint-{step}"
        _tiny_llama(seed).save_pretrained(ckpt)
        (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 4.2}\n')
    (run / "recipe.yaml").write_text("train: {max_steps: 4}\n")
    (run / "summary.json").write_text("{}")
    return run


def _snapshot(root: Path) -> dict[str, bytes | str]:
    """Every file, directory and link under ``root``, with the bytes of each file (and each link's target)."""
    tree: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            tree[rel] = ("link:" + os.readlink(path)) if path.is_symlink() else ("dir" if path.is_dir() else path.read_bytes())
    return tree


def _cli(capsys, *argv) -> tuple[int, str, str]:
    from neutrain.cli import main

    rc = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err



# ---------------------------------------------------------------- class 2: export never destroys its output


def _make_target(kind: str, root: Path, run: Path) -> Path:
    if kind == "run-dir":
        return run
    if kind == "checkpoint":
        return run / "checkpoint-4"
    if kind == "file":
        target = root / "notes.txt"
        target.write_text("my notes\n")
        return target
    if kind == "unrelated-dir":
        target = root / "mine"
        (target / "sub").mkdir(parents=True)
        (target / "data.bin").write_bytes(os.urandom(64))
        (target / "sub" / "x.txt").write_text("x")
        return target
    if kind == "dir-with-export-marker-and-subdir":  # a marker alone does not make a run an export
        target = root / "mixed"
        (target / "checkpoint-1").mkdir(parents=True)
        (target / "neutrain_export.json").write_text('{"format": "hf"}')
        return target
    if kind == "symlink":
        target = root / "link"
        target.symlink_to(run / "checkpoint-2", target_is_directory=True)
        return target
    raise AssertionError(kind)


@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
@pytest.mark.parametrize("kind", ["run-dir", "checkpoint", "file", "unrelated-dir", "dir-with-export-marker-and-subdir", "symlink"])
def test_export_refuses_an_output_that_is_not_a_previous_export(tmp_path, capsys, kind, overwrite):
    run = _fake_run(tmp_path)
    target = _make_target(kind, tmp_path, run)
    before = _snapshot(tmp_path)
    rc, _, err = _cli(capsys, "export", run / "checkpoint-4", "--output", target, *(["--overwrite"] if overwrite else []))
    assert rc == 2
    line = one_error_line(err)
    assert f"'{target}'" in line and "not a neutrain export" in line
    assert _snapshot(tmp_path) == before, "a refused export changed files"


def test_export_over_a_previous_export_needs_overwrite_and_replaces_only_it(tmp_path, capsys):
    run = _fake_run(tmp_path)
    export = tmp_path / "exports" / "model"
    rc, out, err = _cli(capsys, "export", run / "checkpoint-2", "--output", export)
    assert rc == 0, err
    assert json.loads((export / "neutrain_export.json").read_text())["checkpoint"].endswith("checkpoint-2")
    (tmp_path / "exports" / "keep.txt").write_text("a sibling of the export")

    before = _snapshot(tmp_path)
    rc, _, err = _cli(capsys, "export", run / "checkpoint-4", "--output", export)
    assert rc == 2 and "--overwrite" in one_error_line(err)
    assert _snapshot(tmp_path) == before

    rc, out, err = _cli(capsys, "export", run / "checkpoint-4", "--output", export, "--overwrite")
    assert rc == 0, err
    assert json.loads((export / "neutrain_export.json").read_text())["checkpoint"].endswith("checkpoint-4")
    exported, trained = load_file(export / "model.safetensors"), load_file(run / "checkpoint-4" / "model.safetensors")
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)
    after = _snapshot(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("exports/model")} == \
        {k: v for k, v in before.items() if not k.startswith("exports/model")}, "files outside the export changed"
    assert sorted(p.name for p in (tmp_path / "exports").iterdir()) == ["keep.txt", "model"], "temporaries left"


def test_failed_export_keeps_the_previous_export_and_removes_its_temporary(tmp_path, capsys, monkeypatch):
    import neutrain.export.hf as hf

    run = _fake_run(tmp_path)
    export = tmp_path / "export"
    assert _cli(capsys, "export", run / "checkpoint-2", "--output", export)[0] == 0
    before = _snapshot(tmp_path)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf, "_model_card", disk_full)  # fails after the weights are written
    rc, _, err = _cli(capsys, "export", run / "checkpoint-4", "--output", export, "--overwrite")
    assert rc == 1 and "No space left" in one_error_line(err)  # an environment failure: one line, exit 1
    assert _snapshot(tmp_path) == before, "the previous export changed or a temporary was left behind"


def test_export_into_an_empty_directory_or_a_new_path_works(tmp_path, capsys):
    run = _fake_run(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    for target in (empty, tmp_path / "new" / "deeper"):
        rc, _, err = _cli(capsys, "export", run / "checkpoint-4", "--output", target)
        assert rc == 0, err
        assert (target / "neutrain_export.json").is_file() and (target / "model.safetensors").is_file()


def test_export_below_a_file_is_one_line_not_a_traceback(tmp_path, capsys):
    run = _fake_run(tmp_path)
    (tmp_path / "notes.txt").write_text("my notes\n")
    before = _snapshot(tmp_path)
    rc, _, err = _cli(capsys, "export", run / "checkpoint-4", "--output", tmp_path / "notes.txt" / "export")
    line = one_error_line(err)
    assert rc == 1 and "--output is not writable" in line and "notes.txt" in line  # an environment failure: exit 1
    assert _snapshot(tmp_path) == before


def test_export_of_a_missing_path_says_it_does_not_exist(tmp_path, capsys):
    missing = tmp_path / "no-such-run"
    rc, _, err = _cli(capsys, "export", missing, "--output", tmp_path / "export")
    assert rc == 2
    line = one_error_line(err)
    assert f"'{missing}' does not exist" in line and "config.json" not in line
    assert not (tmp_path / "export").exists()


def _train(capsys, recipe: Path, *overrides) -> tuple[int, str, str]:
    return _cli(capsys, "train", recipe, *overrides)


FAST = {"max_steps": 2, "save_steps": 2}


@pytest.mark.parametrize("where", ["unrelated-dir", "train-output-dir", "parent-of-train-output-dir"])
def test_recipe_export_refuses_a_non_export_before_training(tmp_path, capsys, where):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("years of work")
    target = {"unrelated-dir": tmp_path / "mine", "train-output-dir": tmp_path / "out", "parent-of-train-output-dir": tmp_path}[where]
    recipe = write_recipe(tmp_path, train=FAST, export={"output_dir": str(target)})
    before = _snapshot(tmp_path)
    rc, _, err = _train(capsys, recipe)
    assert rc == 2
    assert "export.output_dir" in one_error_line(err)
    assert _snapshot(tmp_path) == before, "the run wrote or deleted files although its export target was refused"


def test_recipe_export_replaces_a_previous_export(tmp_path, capsys):
    """A relaunched run (here: a second run sharing export.output_dir) re-exports over the previous export."""
    shared = tmp_path / "shared-export"
    for i, seed in enumerate((1, 2)):
        recipe = write_recipe(tmp_path / f"run{i}", train={**FAST, "seed": seed}, eval={"perplexity": False},
                              export={"output_dir": str(shared)})
        rc, _, err = _train(capsys, recipe)
        assert rc == 0, err
        weights = load_file(shared / "model.safetensors")
        final = load_file(tmp_path / f"run{i}" / "out" / "checkpoint-2" / "model.safetensors")
        assert all(torch.equal(weights[k], final[k]) for k in final), f"run {i}: the export is not its final weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run0", "run1", "shared-export"], "temporaries left"


# ---------------------------------------------------------------- class 7: non-finite steps


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, length: int = 16):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i], "attention_mask": torch.ones_like(self.ids[i])}


def _injecting_trainer(tmp_path: Path, optimizer: str, nan_steps: set[int], where: str, max_steps: int = 6, limit: int = 10):
    """A NeuTrainer on a tiny Llama whose loss (or one weight's gradient) is NaN at ``nan_steps``."""
    from transformers import TrainerCallback, TrainingArguments

    from neutrain.trainer import NeuTrainer

    class Injecting(NeuTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if where.startswith("loss") and not return_outputs and self.state.global_step + 1 in nan_steps:
                # "loss-inf": an infinite loss whose gradients stay finite (a constant added)
                loss = loss * NAN if where == "loss" else loss + float("inf")
            return loss

    class Snapshots(TrainerCallback):
        """Weights and optimizer state just before and just after each injected step."""

        def __init__(self):
            self.before, self.after = {}, {}

        def _grab(self, model, optimizer):
            return ({n: p.detach().clone() for n, p in model.named_parameters()}, copy.deepcopy(optimizer.state_dict()["state"]))

        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            if state.global_step + 1 in nan_steps:
                self.before[state.global_step + 1] = self._grab(model, optimizer)

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
            if state.global_step in nan_steps:
                self.after[state.global_step] = self._grab(model, optimizer)

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=max_steps, per_device_train_batch_size=2, learning_rate=1e-2,
        weight_decay=0.1, lr_scheduler_type="linear", logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
        optim={"adamw": "adamw_torch", "sgd": "sgd"}[optimizer], disable_tqdm=True, seed=0,
    )
    trainer = Injecting(model=_tiny_llama(0), args=args, train_dataset=_Rows(),
                        memory={"optimizer": optimizer, "max_consecutive_nonfinite": limit})
    if where == "grad":
        weight = trainer.model.model.layers[0].mlp.up_proj.weight
        weight.register_hook(lambda g: g * NAN if trainer.state.global_step + 1 in nan_steps else g)
    snaps = Snapshots()
    trainer.add_callback(snaps)
    return trainer, snaps


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[i].keys() == b[i].keys() and all(torch.equal(torch.as_tensor(a[i][k]), torch.as_tensor(b[i][k])) for k in a[i]) for i in a)


@pytest.mark.parametrize("optimizer,where", [("adamw", "loss"), ("adamw", "grad"), ("adamw", "loss-inf"),
                                              ("sgd", "loss"), ("sgd", "grad")])
def test_nonfinite_step_is_skipped_logged_and_counted(tmp_path, caplog, optimizer, where):
    trainer, snaps = _injecting_trainer(tmp_path, optimizer, {3}, where)
    with caplog.at_level("WARNING"):
        trainer.train()
    weights_before, state_before = snaps.before[3]
    weights_after, state_after = snaps.after[3]
    for name, value in weights_before.items():
        assert torch.equal(weights_after[name], value), f"step 3 changed {name}"
    assert _same_state(state_after, state_before), "step 3 changed the optimizer state"
    final = dict(trainer.model.named_parameters())
    assert all(bool(torch.isfinite(p).all()) for p in final.values())
    assert any(not torch.equal(final[n], weights_after[n]) for n in final), "training did not continue after the skip"
    assert trainer.state.global_step == 6 and trainer.nonfinite_skipped_steps == 1
    assert "step 3: non-finite loss or gradient" in caplog.text

    records = {r["step"]: r for r in read_metrics(tmp_path / "out" / "metrics.jsonl") if "loss" in r}
    assert sorted(records) == [1, 2, 3, 4, 5, 6]
    if where.startswith("loss"):
        logged = records[3]["loss"]
        assert (math.isnan(logged) if where == "loss" else logged == math.inf), f"the loss was logged as {logged}"
    assert all(math.isfinite(records[s]["loss"]) for s in (1, 2, 4, 5, 6))
    assert [records[s]["nonfinite_skipped_steps"] for s in range(1, 7)] == [0, 0, 1, 1, 1, 1]
    # The schedule advances through a skipped step (linear decay to 0 over 6 steps, read before each update).
    assert [records[s]["learning_rate"] for s in range(1, 7)] == pytest.approx([1e-2 * (1 - (s - 1) / 6) for s in range(1, 7)])


def test_guard_checks_every_gradient_and_keeps_large_finite_ones():
    """One inf in one tensor skips the whole update; huge but finite bf16 gradients do not (no norm overflow)."""
    from neutrain.optim.nonfinite import all_finite, watch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    monitor = watch(opt, max_consecutive=10)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    before, state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()["state"])
    model(torch.randn(3, 4)).sum().backward()
    model[1].bias.grad[0] = float("inf")
    opt.step()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert _same_state(opt.state_dict()["state"], state) and monitor.skipped_steps == 1 and monitor.consecutive == 1
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert monitor.consecutive == 0 and not torch.equal(model[0].weight, before["0.weight"])

    huge = torch.full((1024,), 3e38, dtype=torch.bfloat16)  # its 2-norm overflows; every element is finite
    assert bool(all_finite([huge, torch.ones(3)])) and not bool(all_finite([huge, torch.tensor([NAN])]))


def test_a_noted_loss_counts_only_for_its_own_step():
    """An inf loss skips its step even with finite gradients; one from a step that never stepped is dropped."""
    from neutrain.optim.nonfinite import watch

    model, step = torch.nn.Linear(4, 2), [1]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = watch(opt, max_consecutive=10, current_step=lambda: step[0])
    model(torch.randn(3, 4)).sum().backward()
    monitor.note_loss(torch.tensor(float("inf")))
    before = copy.deepcopy(model.state_dict())
    opt.step()
    assert monitor.skipped_steps == 1 and torch.equal(model.weight, before["weight"])
    step[0] = 2
    monitor.note_loss(torch.tensor(float("inf")))  # step 2 is never taken (say, an fp16 overflow skipped it)
    step[0] = 3
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert monitor.skipped_steps == 1 and not torch.equal(model.weight, before["weight"])


def test_skip_count_continues_across_a_resume():
    from neutrain.optim.nonfinite import NonFiniteMonitor

    monitor = NonFiniteMonitor(max_consecutive=3)
    history = [{"step": 1, "nonfinite_skipped_steps": 0}, {"step": 2, "nonfinite_skipped_steps": 2}, {"step": 3, "eval_loss": 1.0}]
    assert monitor.total(history) == 2
    monitor.record(True)
    assert monitor.total(history + [{"step": 4, "nonfinite_skipped_steps": 3}]) == 3


def _nan_from(monkeypatch, first_step: int) -> None:
    """Make every training loss NaN from ``first_step`` on (in-process runs through the CLI)."""
    from neutrain.trainer import NeuTrainer

    original = NeuTrainer.compute_loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = original(self, model, inputs, return_outputs, num_items_in_batch)
        return loss * NAN if not return_outputs and self.state.global_step + 1 >= first_step else loss

    monkeypatch.setattr(NeuTrainer, "compute_loss", compute_loss)


@pytest.mark.parametrize("optimizer", ["adamw", "adalomo"])
def test_consecutive_nonfinite_steps_stop_the_run_with_exit_2(tmp_path, capsys, monkeypatch, optimizer):
    _nan_from(monkeypatch, 3)
    recipe = write_recipe(tmp_path, train={"max_steps": 10, "save_steps": 2, "optimizer": optimizer, "max_consecutive_nonfinite": 3},
                          eval={"perplexity": False})
    rc, _, err = _train(capsys, recipe)
    assert rc == 2
    line = one_error_line(err)
    assert "3 optimizer steps in a row (steps 3-5)" in line and "train.max_consecutive_nonfinite: 3" in line
    out = tmp_path / "out"
    assert (out / "checkpoint-2" / "model.safetensors").is_file() and (out / "checkpoint-4" / "model.safetensors").is_file()
    assert all(bool(torch.isfinite(t).all()) for t in load_file(out / "checkpoint-4" / "model.safetensors").values())
    losses = {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}
    assert math.isfinite(losses[2]) and math.isnan(losses[3]) and math.isnan(losses[4])
    assert not (out / "export").exists()


def test_run_with_one_nonfinite_step_finishes_and_its_summary_counts_it(tmp_path, capsys, monkeypatch):
    from neutrain.trainer import NeuTrainer

    original = NeuTrainer.compute_loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = original(self, model, inputs, return_outputs, num_items_in_batch)
        return loss * NAN if not return_outputs and self.state.global_step + 1 == 2 else loss

    monkeypatch.setattr(NeuTrainer, "compute_loss", compute_loss)
    recipe = write_recipe(tmp_path, train={"max_steps": 4, "save_steps": 4}, eval={"perplexity": False})
    rc, out, err = _train(capsys, recipe)
    assert rc == 0, err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["nonfinite_skipped_steps"] == 1 and "1 optimizer steps had a non-finite" in out
    assert math.isfinite(summary["loss_last"])
    assert all(bool(torch.isfinite(t).all()) for t in load_file(tmp_path / "out" / "export" / "model.safetensors").values())
