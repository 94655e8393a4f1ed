"""No output folder is, or lies inside, a file or folder the run reads, and nothing it reads lies where it writes.

Before: ``train.output_dir=DATA/run`` (a data folder is read whole, every data file below it) wrote the run's
``tokenizer/tokenizer.json`` among the data and failed reading it as a data row ("row 0 is not valid JSON"), its
``metrics.jsonl`` a data file for the next start; a ``model.base_model`` kept in the run's ``checkpoint-N`` or
``export`` was rotated away or replaced by the run's own export; an export into the base model's folder replaced
the model trained from. The table crosses every input key (:data:`neutrain.cli.outputs.INPUT_KEYS`, and a data
set) with each way an output and an input can overlap.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from neutrain.cli import main
from neutrain.cli.outputs import INPUT_KEYS, check_output_places
from neutrain.config import RecipeError, validate_recipe
from neutrain.config.schema import SCHEMA
from tests.helpers import TINY_LLAMA, TINY_RECIPE, one_error_line, write_recipe

DATA = "data.datasets[0].path"
# A GGUF file needs a real one (a model of its own) and a folder input of its own kind; a file input's overlaps
# are the same as model.config's.
KEYS = [key for key in INPUT_KEYS if key != "model.gguf_file"] + [DATA]
FILES = ("model.config", "train.deepspeed", "train.fsdp_config")
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# Read from the run's own products by design: a resume, a distillation.
OWN_PRODUCTS = (("train.resume_from_checkpoint", "it inside the run's checkpoint"),
                ("distill.target", "it inside the run's checkpoint"), ("distill.target", "it inside the export"),
                ("distill.target", "export inside it"))  # distil the run's export: read after the run wrote it
RELATIONS = ["run inside it", "export inside it", "run is it", "it inside the run's checkpoint",
             "it inside the run's tokenizer", "it inside the run's draft", "it inside the export"]


def _place(key: str, where: Path, run: Path) -> str:
    """A valid value of ``key`` made at ``where``, from the finished tiny ``run``."""
    where.parent.mkdir(parents=True, exist_ok=True)
    if key in FILES:
        where.write_text(json.dumps({"model_type": "llama", **TINY_LLAMA} if key == "model.config" else {}))
    elif key == "model.tokenizer":
        shutil.copytree(run / "tokenizer", where)
    elif key == "train.resume_from_checkpoint":
        shutil.copytree(run / "checkpoint-2", where)
    elif key in ("model.base_model", "distill.target"):  # a model folder that is not neutrain's (a download)
        shutil.copytree(run / "checkpoint-2", where, ignore=lambda _, names: [n for n in names if n not in MODEL_FILES])
    else:
        where.mkdir()
        (where / "rows.jsonl").write_text("".join(json.dumps({"text": f"row {i} " * 20}) + "\n" for i in range(8)))
    return str(where)


def _recipe(tmp_path: Path, run: Path, key: str, relation: str):
    raw = copy.deepcopy(TINY_RECIPE)
    out, export = tmp_path / "out", tmp_path / "exported"
    if relation in ("run inside it", "export inside it", "run is it"):
        value = _place(key, tmp_path / "input", run)
        out = {"run inside it": Path(value) / "run", "run is it": Path(value)}.get(relation, out)
        export = Path(value) / "export" if relation == "export inside it" else export
    else:
        inside = {"it inside the run's checkpoint": out / "checkpoint-2", "it inside the run's tokenizer": out / "tokenizer",
                  "it inside the run's draft": out / "draft", "it inside the export": export}[relation]
        value = _place(key, inside / "input", run)
    raw["train"]["output_dir"], raw["export"]["output_dir"] = str(out), str(export)
    if key == DATA:
        raw["data"]["datasets"] = [{"path": value, "type": "text"}]
    else:
        section, name = key.split(".")
        raw.setdefault(section, {})[name] = value
    return validate_recipe(raw)


def _table():
    for key in KEYS:
        for relation in RELATIONS:
            if key in FILES and relation in ("run inside it", "export inside it", "run is it"):
                continue  # a file holds no folder; one that is the output folder is refused as a file
            if (key, relation) in OWN_PRODUCTS:
                continue  # read from the run's own products by design (a resume, a distillation of its export)
            if key == "train.resume_from_checkpoint" and relation in ("run inside it", "run is it", "export inside it"):
                continue  # an output inside the checkpoint it resumes is refused as one inside a checkpoint
            yield key, relation


TABLE = list(_table())


@pytest.mark.parametrize(("key", "relation"), TABLE, ids=[f"{k}:{r}" for k, r in TABLE])
def test_an_output_never_overlaps_what_the_run_reads(tiny_run, tmp_path, key, relation):
    recipe = _recipe(tmp_path, tiny_run, key, relation)
    with pytest.raises(RecipeError) as refused:
        check_output_places(recipe)
    message = str(refused.value)
    assert "\n" not in message and key in message, message
    assert ("export" in message) == ("export" in relation), message


def test_every_declared_path_key_is_an_input():
    declared = {f"{section}.{name}" for section, keys in SCHEMA.items() for name, key in keys.items()
                if getattr(key, "path", None) and name != "output_dir"}
    assert declared <= set(INPUT_KEYS)


COMMANDS = {"train": lambda recipe, run: ["train", str(recipe)],
            "eval": lambda recipe, run: ["eval", str(run / "checkpoint-2"), "--recipe", str(recipe)],
            "distill": lambda recipe, run: ["distill", str(recipe)]}


@pytest.mark.parametrize("command", COMMANDS)
def test_no_command_writes_into_the_data_folder_it_reads(tiny_run, tmp_path, capsys, command):
    data = tmp_path / "data"
    data.mkdir()
    (data / "rows.jsonl").write_text("".join(json.dumps({"text": f"row {i} " * 20}) + "\n" for i in range(64)))
    recipe = write_recipe(tmp_path, data={"datasets": [{"path": str(data), "type": "text"}]},
                          train={"output_dir": str(data / "run"), "max_steps": 1}, export={"format": "none"})
    assert main(COMMANDS[command](recipe, tiny_run)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"train.output_dir '{data / 'run'}' lies inside {DATA} '{data}'" in line, line
    assert sorted(p.name for p in data.iterdir()) == ["rows.jsonl"]


def test_a_distillation_target_may_be_the_runs_export(tiny_run, tmp_path):
    raw = copy.deepcopy(TINY_RECIPE)
    raw["train"]["output_dir"], raw["export"]["output_dir"] = str(tmp_path / "out"), str(tmp_path / "exported")
    (tmp_path / "exported").mkdir()
    for target in (tmp_path / "exported", tmp_path / "out" / "export"):
        target.mkdir(parents=True, exist_ok=True)
        raw["distill"] = {"target": str(target)}
        check_output_places(validate_recipe(raw))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """A finished LoRA run on a random base, which it wrote to <out>/base (an export of its own)."""
    from tests.helpers import finished_run

    return finished_run(tmp_path_factory.mktemp("lora"), train={"max_steps": 2, "save_steps": 2},
                        eval={"perplexity": False}, export={"format": "none"},
                        memory={"weights": "dense", "adapter": "lora", "lora_r": 4})


EXPORTS = {  # `neutrain export RUN/checkpoint-2 ...` of a LoRA run (a copy at RUN) -> the model it must leave whole
    "--output its base": (lambda run: ["--output", str(run / "base")], "base"),
    "--output its base, named --base": (lambda run: ["--output", str(run / "base"), "--base", str(run / "base")], "base"),
    "--output inside its base": (lambda run: ["--output", str(run / "base" / "merged")], "base"),
    "--output through a link to its base": (lambda run: ["--output", str(run / "link" / "base")], "base"),
    "--output the checkpoint": (lambda run: ["--output", str(run / "checkpoint-2")], "checkpoint-2"),
}


@pytest.mark.parametrize("case", EXPORTS)
def test_an_export_never_replaces_or_writes_among_what_it_reads(lora_run, tmp_path, capsys, case):
    argv, kept = EXPORTS[case]
    run = tmp_path / "run"
    shutil.copytree(lora_run, run, symlinks=True)
    (run / "link").symlink_to(run)
    before = {p.name: p.read_bytes() for p in (run / kept).iterdir()}
    assert main(["export", str(run / "checkpoint-2"), "--overwrite", *argv(run)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("neutrain: error: --output '"), line
    assert {p.name: p.read_bytes() for p in (run / kept).iterdir()} == before
