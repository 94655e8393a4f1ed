"""A name a recipe gives from a registry (a long-context task, a KV cache, an optimizer) is checked when the recipe is
loaded, by every command that reads one, before a model is built or a checkpoint read.

``neutrain eval CKPT --recipe R eval.long_context_tasks=[niah_singel]`` loaded the checkpoint, evaluated it and
then ended in a ``KeyError`` traceback: the task names were checked only by ``train``'s preflight. So were the
tasks' prompts against ``eval.context_len`` in the model's tokenizer: ``neutrain eval`` evaluated the held-out data,
then a ``ValueError`` traceback.
"""

from __future__ import annotations

import pytest

from neutrain.cli import main as run_command
from tests.helpers import one_error_line, write_recipe

# Each registry-named key, a misspelt value, and the start of its one line.
NAMES = {
    "long-context task": ("eval.long_context_tasks=[niah_singel]",
                          "eval.long_context_tasks[0]: unknown task 'niah_singel'. Did you mean 'niah_single'?"),
    "KV cache": ("eval.kv_caches=[ful]", "eval.kv_caches: 'ful' is not one of"),
    "optimizer": ("train.optimizer=adamww", "train.optimizer:"),
}

# Every command that reads a recipe, as argv after the command's name ({recipe}, {checkpoint}).
COMMANDS = {
    "train": ["train", "{recipe}"],
    "eval of a recipe": ["eval", "{recipe}"],
    "eval of a checkpoint": ["eval", "{checkpoint}", "--recipe", "{recipe}"],
    "estimate": ["estimate", "{recipe}"],
    "distill": ["distill", "{recipe}"],
}


@pytest.fixture
def nothing_loaded(monkeypatch):
    """Fail the test if a model is built or a checkpoint read before the refusal."""
    import neutrain.cli.checkpoints
    import neutrain.cli.eval  # imported before the patch: it binds the loader's name at its import
    import neutrain.trainer.modeling

    def loaded(*args, **kwargs):
        raise AssertionError("a model was built or read before the recipe's names were checked")

    monkeypatch.setattr(neutrain.trainer.modeling, "build_model", loaded)
    for module in (neutrain.cli.checkpoints, neutrain.cli.eval):
        monkeypatch.setattr(module, "load_model_checkpoint", loaded)


@pytest.mark.parametrize("name", list(NAMES))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_misnamed_registry_value_is_refused_at_load_by_every_command(tiny_run, tmp_path, capsys, nothing_loaded,
                                                                       command, name):
    override, start = NAMES[name]
    recipe = write_recipe(tmp_path, eval={"context_len": 128}, distill={"enabled": True})
    argv = [a.format(recipe=recipe, checkpoint=tiny_run / "checkpoint-2") for a in COMMANDS[command]]
    assert run_command([*argv, override]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"neutrain: error: {start}"), line


@pytest.mark.parametrize("task", ["niah_single", "frequent_words"])
def test_eval_refuses_a_task_its_context_cannot_hold_before_it_evaluates(tiny_run, tmp_path, capsys, monkeypatch, task):
    from neutrain.trainer import NeuTrainer

    def evaluated(*args, **kwargs):
        raise AssertionError("the held-out data was evaluated before the refusal")

    monkeypatch.setattr(NeuTrainer, "evaluate", evaluated)
    recipe = write_recipe(tmp_path, train={"output_dir": str(tmp_path / "evals")})
    code = run_command(["eval", str(tiny_run / "checkpoint-2"), "--recipe", str(recipe),
                        f"eval.long_context_tasks=[{task}]", "eval.context_len=64"])
    line = one_error_line(capsys.readouterr().err)
    assert code == 2 and line.startswith(f"neutrain: error: eval.context_len: 64 tokens is too short for long-context "
                                         f"task '{task}'"), line
