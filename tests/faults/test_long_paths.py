"""A path too long for its file system is refused at the boundary, naming the key or argument that gave it.

Why: a name past ``NAME_MAX`` (or a path past ``PATH_MAX``) cannot even be looked up: the first ``stat`` on it
raises ``ENAMETOOLONG``. An ``export.output_dir`` of 300 characters ended in "file system error (<path>):
File name too long", exit 1, naming neither the key nor a fix, and an input path of that length was said not to
exist. Every path-valued recipe key and every command's path argument is now measured where it enters.
"""

from __future__ import annotations

import pytest

from tests.helpers import one_error_line, write_recipe

LONG_NAME = "n" * 300  # past NAME_MAX (255 on every Linux file system)
DEEP = "/".join(["d" * 250] * 17)  # each name fits, the whole is past PATH_MAX (4096)

RECIPE_KEYS = ["train.output_dir", "export.output_dir", "distill.target", "model.config",
               "model.tokenizer", "model.base_model", "model.gguf_file", "train.deepspeed", "train.fsdp_config",
               "train.resume_from_checkpoint", "data.datasets"]


def _override(key: str, value: str) -> str:
    if key == "data.datasets":
        return f"data.datasets=[{{path: '{value}', type: text}}]"
    return f"{key}={value}"


@pytest.mark.parametrize("shape", ["name", "path"])
@pytest.mark.parametrize("key", RECIPE_KEYS)
def test_every_path_key_refuses_a_path_its_file_system_cannot_hold(tmp_path, key, shape):
    from neutrain.config import load_recipe
    from neutrain.errors import RecipeError

    recipe = write_recipe(tmp_path)
    value = str(tmp_path / (LONG_NAME if shape == "name" else DEEP))
    with pytest.raises(RecipeError) as caught:
        load_recipe(str(recipe), [_override(key, value)])
    message = str(caught.value)
    assert key in message and "too long for its file system" in message, message
    assert ("NAME_MAX" if shape == "name" else "PATH_MAX") in message, message


COMMANDS = {
    "train recipe": (["train", "{long}"], "recipe"),
    "distill recipe": (["distill", "{long}"], "recipe"),
    "estimate recipe": (["estimate", "{long}"], "recipe"),
    "eval target": (["eval", "{long}", "--recipe", "{recipe}"], "target"),
    "eval --recipe": (["eval", "{dir}", "--recipe", "{long}"], "--recipe"),
    "export checkpoint": (["export", "{long}"], "checkpoint"),
    "export --output": (["export", "{dir}", "--output", "{long}"], "--output"),
    "export --base": (["export", "{dir}", "--base", "{long}"], "--base"),
    "generate model": (["generate", "{long}", "--prompt", "hi"], "model"),
    "generate --draft": (["generate", "{dir}", "--prompt", "hi", "--draft", "{long}"], "--draft"),
    "generate --input-file": (["generate", "{dir}", "--input-file", "{long}"], "--input-file"),
    "chat model": (["chat", "{long}"], "model"),
}


@pytest.mark.parametrize("shape", ["name", "path"])
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_path_argument_refuses_a_path_its_file_system_cannot_hold(tmp_path, capsys, command, shape):
    from neutrain.cli import main

    recipe = write_recipe(tmp_path)
    long = str(tmp_path / (LONG_NAME if shape == "name" else DEEP))
    argv, named = COMMANDS[command]
    argv = [a.format(long=long, recipe=recipe, dir=tmp_path) for a in argv]
    assert main(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert named in line and "too long for its file system" in line, line


def test_a_long_export_output_dir_is_refused_before_anything_is_written(tmp_path, capsys):
    from neutrain.cli import main

    recipe = write_recipe(tmp_path)
    assert main(["train", str(recipe), f"export.output_dir={tmp_path / LONG_NAME}"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "export.output_dir" in line and "NAME_MAX" in line, line
    assert not (tmp_path / "out").exists()


# Names that fit, beside which an export writes a name that does not: its lock (".neutrain-export-<name>.lock",
# 22 bytes more), then its set-aside copy (".tmp-old-<name>-<pid>", 17 more), then its staging folder (13 more).
SIBLING_NAMES = {"the lock": 234, "the set-aside copy": 239, "the staging folder": 243}
EXPORTS = {"train export.output_dir": (["train", "{recipe}", "export.output_dir={out}"], "export.output_dir"),
           "export --output": (["export", "{checkpoint}", "--output", "{out}"], "--output")}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.helpers import finished_run

    return finished_run(tmp_path_factory.mktemp("run"), train={"max_steps": 1, "save_steps": 1},
                        eval={"perplexity": False}, export={"format": "none"}) / "checkpoint-1"


@pytest.mark.parametrize("beside", SIBLING_NAMES)
@pytest.mark.parametrize("command", EXPORTS)
def test_every_export_refuses_a_name_whose_siblings_its_file_system_cannot_hold(tmp_path, capsys, checkpoint,
                                                                                 command, beside):
    from neutrain.cli import main

    out = tmp_path / ("e" * SIBLING_NAMES[beside])
    argv, named = EXPORTS[command]
    argv = [a.format(recipe=write_recipe(tmp_path), checkpoint=checkpoint, out=out) for a in argv]
    assert main(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"neutrain: error: {named}: ") and "NAME_MAX" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.yaml"]  # nothing written, the lock included
