"""Commands start in seconds: what each one imports, counted in a fresh interpreter (never timed).

A command's module is imported only when it runs, ``estimate`` is arithmetic on a config (no
Trainer, peft, datasets, model code or codec), and every argument or file mistake is refused in one
line before torch is imported at all.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Modules whose import is what made a command slow to start: the Trainer (with peft and datasets behind
# it), the model code, the NeuZip codec (numba) and the Triton kernels.
HEAVY = ("transformers.trainer", "transformers.modeling_utils", "peft", "datasets", "numba", "triton",
         "neutrain.nn", "neutrain.trainer.trainer")

_PROBE = """
import json, sys
from neutrain.cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
sys.stdout.flush()
print("\\nIMPORTED " + json.dumps({"code": code, "modules": sorted(sys.modules)}), file=sys.stderr)
"""


def imports_of(*argv, cwd: Path = REPO) -> tuple[int, set[str], str]:
    """``(exit code, modules imported, stderr without the probe's line)`` of ``neutrain *argv`` in a new interpreter."""
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    res = subprocess.run([sys.executable, "-c", _PROBE, *map(str, argv)], capture_output=True, text=True, env=env,
                         cwd=cwd, timeout=300)
    head, _, probe = res.stderr.rpartition("\nIMPORTED ")
    assert probe, res.stderr
    found = json.loads(probe)
    return found["code"], set(found["modules"]), head


def _loaded(modules: set[str], names) -> list[str]:
    return [n for n in names if n in modules]


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["recipes"], ["train", "--help"], ["generate", "--help"],
                                  ["export", "--help"], ["eval", "--help"], ["estimate", "--help"]])
def test_help_version_and_recipes_import_neither_torch_nor_transformers(argv):
    code, modules, _ = imports_of(*argv)
    assert code == 0
    assert not _loaded(modules, ("torch", "transformers", *HEAVY))


_PARSER_PROBE = """
import json, sys
from neutrain.cli.main import _parser
print(json.dumps({"help": _parser().format_help(), "modules": sorted(sys.modules)}))
"""


def test_the_top_level_parser_lists_every_command_and_imports_none():
    # The command table holds each command's module path and its help line, so the top-level parser (what
    # `neutrain --help` prints) is built without importing a command's module, nor what those import.
    from neutrain.cli.main import COMMANDS

    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="200")  # one line per command, however long its help
    res = subprocess.run([sys.executable, "-c", _PARSER_PROBE], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    found = json.loads(res.stdout.splitlines()[-1])
    modules = set(found["modules"])
    assert not _loaded(modules, ("torch", "transformers", "peft", "datasets"))
    assert not _loaded(modules, [command.module for command in COMMANDS.values()])
    for name, command in COMMANDS.items():
        assert re.search(rf"^ +{name} +{re.escape(command.help)}$", found["help"], re.MULTILINE), (name, found["help"])


def test_every_command_module_provides_its_arguments_and_its_run():
    from neutrain.cli.main import COMMANDS

    for name, command in COMMANDS.items():
        module = importlib.import_module(command.module)
        assert callable(module.configure) and callable(module.run), name


def test_only_the_command_that_runs_is_imported():
    _, modules, _ = imports_of("recipes")
    others = [m for m in ("train", "eval", "export", "estimate", "distill", "generate") if f"neutrain.cli.{m}" in modules]
    assert not others


def test_estimate_imports_no_trainer_model_code_or_codec():
    code, modules, _ = imports_of("estimate", "recipes/default.yaml")
    assert code == 0
    assert not _loaded(modules, HEAVY)


@pytest.mark.parametrize("recipe", ["recipes/default.yaml", "recipes/llama3_8b.yaml"])
def test_estimate_of_a_recipe_giving_its_shape_imports_neither_transformers_nor_torch(recipe):
    from neutrain.compat.deepspeed_env import no_gpu_device_nodes

    code, modules, stderr = imports_of("estimate", recipe)
    assert code == 0, stderr
    assert not _loaded(modules, ("transformers", "huggingface_hub", "safetensors", *HEAVY))
    if no_gpu_device_nodes():  # with GPU device files, `device_budget_gib: auto` asks torch for the card's size
        assert not _loaded(modules, ("torch", "numpy"))


@pytest.mark.parametrize("recipe, budget", [("recipes/default.yaml", "2"), ("recipes/llama3_8b.yaml", "11"),
                                            ("recipes/lora_neuzip.yaml", "12")])
def test_estimate_fitting_a_numeric_budget_imports_neither_transformers_nor_torch(recipe, budget):
    # The layer placement a budget is fitted with is arithmetic (neutrain.config.layer_placement), apart from
    # the weight store that streams the layers (neutrain.nn, torch).
    code, modules, stderr = imports_of("estimate", recipe, f"memory.device_budget_gib={budget}")
    assert code == 0, stderr
    assert not _loaded(modules, ("torch", "numpy", "transformers", "huggingface_hub", "safetensors", *HEAVY))


def test_argument_and_file_errors_come_before_torch(tmp_path):
    checkpoint = tmp_path / "run" / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text("{}")
    (checkpoint / "model.safetensors").write_bytes(b"")  # never read: every case is refused before loading
    weightless = tmp_path / "weightless" / "checkpoint-1"
    weightless.mkdir(parents=True)
    (weightless / "config.json").write_text("{}")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    cases = {
        "does not exist": ["export", tmp_path / "missing"],
        "export format 'neuzip-lossy-5' is not available": ["export", checkpoint, "--format", "neuzip-lossy-5"],
        "is not a neutrain export": ["export", checkpoint, "--output", taken],
        "checkpoint '.*gone' does not exist": ["generate", tmp_path / "gone", "--prompt", "hi"],
        "the package 'json' has no file": ["generate", "package:json/none.gguf", "--prompt", "hi"],
        "--max-new-tokens: 0 is out of range": ["generate", checkpoint, "--prompt", "hi", "--max-new-tokens", "0"],
        "--draft: checkpoint .*no-draft' does not exist": ["generate", checkpoint, "--prompt", "hi", "--draft", tmp_path / "no-draft"],
        "recipe file 'nope' does not exist": ["train", "nope"],
        "weightless/checkpoint-1' has no safetensors weights": ["export", weightless.parent],
        "checkpoint .*weightless/checkpoint-1' has no safetensors weights": ["generate", weightless, "--prompt", "hi"],
        "eval: '.*checkpoint-2' is a checkpoint; pass --recipe": ["eval", checkpoint],
        "checkpoint '.*empty-run': no config.json and no checkpoint-N inside":
            ["eval", "recipes/default.yaml", f"train.output_dir={taken.parent / 'empty-run'}"],
        "checkpoint-1' has no safetensors weights": ["eval", weightless.parent, "--recipe", "recipes/default.yaml"],
        "eval: '.*data.jsonl' is a data file": ["eval", tmp_path / "data.jsonl"],
    }
    (tmp_path / "empty-run").mkdir()
    (tmp_path / "data.jsonl").write_text("{}")
    import re
    from concurrent.futures import ThreadPoolExecutor

    # Each case is its own interpreter (the modules it imported are the point): side by side, one a core.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(lambda argv: imports_of(*argv), cases.values()))
    for (expected, argv), (code, modules, stderr) in zip(cases.items(), results):
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and re.search(expected, lines[0]), (argv, stderr)
        assert "torch" not in modules, (argv, "imported torch before refusing")


def test_a_new_run_into_another_runs_directory_is_refused_before_torch(tmp_path):
    # A rerun into a used directory was refused only under the run's lock, after torch and the Trainer loaded.
    from neutrain.config import load_recipe
    from neutrain.storage.run_dir import write_identity
    from neutrain.trainer.ownership import identity_recipe

    used = tmp_path / "used"
    (used / "checkpoint-2").mkdir(parents=True)
    theirs = identity_recipe(load_recipe("recipes/default.yaml", ["train.learning_rate=0.5"]))
    write_identity(used, theirs, ["checkpoint-2"])
    code, modules, stderr = imports_of("train", "recipes/default.yaml", f"train.output_dir={used}")
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, stderr
    assert "holds another run's checkpoints (checkpoint-2)" in lines[0] and "train.learning_rate: 0.5 ->" in lines[0], lines[0]
    assert "torch" not in modules
    assert sorted(p.name for p in used.iterdir()) == [".neutrain-run", "checkpoint-2"]  # nothing written
    # The same recipe (a relaunch), a resume and an overwrite are left to the checks under the run's lock.
    from neutrain.trainer.ownership import refuse_used_directory

    ours = identity_recipe(load_recipe("recipes/default.yaml"))
    refuse_used_directory(str(used), theirs, resume=False, overwrite=False)
    refuse_used_directory(str(used), ours, resume=True, overwrite=False)
    refuse_used_directory(str(used), ours, resume=False, overwrite=True)
    (used / ".neutrain.lock").write_text('{"pid": 1, "host": "elsewhere"}')
    refuse_used_directory(str(used), ours, resume=False, overwrite=False)  # a run's lock there: the lock names it


def test_a_run_into_a_folder_of_the_users_is_refused_before_torch(tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    for flag in ([], ["train.overwrite_output_dir=true"]):  # a folder no run wrote is refused, flag or not
        code, modules, stderr = imports_of("train", "recipes/default.yaml", f"train.output_dir={taken}", *flag)
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and "is not empty and holds no neutrain run (notes.txt)" in lines[0], stderr
        assert "torch" not in modules
    assert [p.name for p in taken.iterdir()] == ["notes.txt"]
    code, modules, stderr = imports_of("train", "recipes/default.yaml", f"train.output_dir={tmp_path / 'new'}",
                                       f"export.output_dir={taken}")
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "export.output_dir '" in lines[0] and "is not a neutrain export" in lines[0], stderr
    assert "torch" not in modules and not (tmp_path / "new").exists()


def test_unknown_recipe_names_the_nearest(tmp_path):
    code, _, stderr = imports_of("train", "defualt")
    assert code == 2 and "did you mean 'default'?" in stderr, stderr
    code, _, stderr = imports_of("estimate", "recipes/defualt.yaml")
    assert code == 2 and "did you mean 'recipes/default.yaml'?" in stderr, stderr
    code, _, stderr = imports_of("train", "zzzzzz")
    assert code == 2 and "did you mean" not in stderr, stderr


@pytest.mark.parametrize("argv, hint", [(["defualt"], "did you mean `neutrain train default`?"),
                                        (["default"], "did you mean `neutrain train default`?"),
                                        (["trian", "recipes/default.yaml"], "did you mean `neutrain train`?")])
def test_an_unknown_command_names_the_nearest_command_or_recipe(argv, hint):
    # argparse printed its usage and the list of commands, with nothing about the recipe that was meant.
    code, modules, stderr = imports_of(*argv)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and hint in lines[0], stderr
    assert "torch" not in modules


def test_light_format_check_knows_the_codecs_lossy_modes():
    from neutrain.compress.layout import LOSSY_MANTISSA_BITS
    from neutrain.export import LOSSY_KS

    assert LOSSY_KS == LOSSY_MANTISSA_BITS
