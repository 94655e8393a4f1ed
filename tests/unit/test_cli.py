"""The command line: user errors are one line with exit code 2, and --help explains."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from neutrain.cli import main
from tests.helpers import write_recipe

REPO = Path(__file__).resolve().parents[2]


def _run(*args):
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "neutrain", *map(str, args)], capture_output=True, text=True, env=env, timeout=300)


def _assert_one_line_error(res, pattern):
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got:\n{res.stderr}"
    assert "Traceback" not in res.stderr
    assert lines[0].startswith("neutrain: error: ")
    import re

    assert re.search(pattern, lines[0]), lines[0]


def test_unknown_key_exits_2_with_one_line(tmp_path):
    recipe = write_recipe(tmp_path, train={"learning_rat": 1e-3})
    _assert_one_line_error(_run(recipe), r"train: unknown key 'learning_rat'\. Did you mean 'learning_rate'\?")


def test_wrong_type_exits_2_with_one_line(tmp_path):
    recipe = write_recipe(tmp_path, train={"max_steps": "many"})
    _assert_one_line_error(_run(recipe), r"train\.max_steps: expected an integer, got str 'many'")


def test_missing_data_file_exits_2_with_one_line(tmp_path):
    recipe = write_recipe(tmp_path, data={"datasets": [{"path": str(tmp_path / "missing.jsonl"), "type": "completion"}]})
    _assert_one_line_error(_run("train", recipe), r"data\.datasets\[0\]\.path: data file '.*missing\.jsonl' does not exist")


@pytest.mark.slow
def test_bad_override_and_missing_recipe_and_checkpoint(tmp_path):
    recipe = write_recipe(tmp_path)
    _assert_one_line_error(_run(recipe, "train.micro_batch_size=-3"), r"train\.micro_batch_size: -3 is below the minimum 1")
    _assert_one_line_error(_run("train", tmp_path / "nope.yaml"), r"recipe file '.*nope\.yaml' does not exist")
    _assert_one_line_error(_run("export", tmp_path), r"checkpoint '.*': no config\.json and no checkpoint-N inside")


def test_help_lists_commands_and_recipe_keys(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for word in ("train", "eval", "export", "recipes", "accelerate launch -m neutrain"):
        assert word in text
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for key in ("micro_batch_size", "gradient_accumulation_steps", "sequence_len", "base_model", "weights"):
        assert key in text


def test_recipes_lists_shipped_recipes(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("default")
    assert "recipes/default.yaml" in out


def test_the_cli_turns_on_expandable_segments_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert main(["recipes"]) == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert main(["recipes"]) == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"


class _Writes:
    """A stderr that records each ``write`` call."""

    def __init__(self):
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_an_error_line_and_its_newline_are_one_write(monkeypatch, tmp_path):
    # Two torchrun workers share a stderr pipe: `print` writes the text and the newline apart, and
    # their lines fused between the two writes ("...checkpoint-4neutrain: error: ..."). A pipe write
    # under 4 KiB is atomic, so each error line must be one write.
    writes = _Writes()
    monkeypatch.setattr(sys, "stderr", writes)
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    monkeypatch.setenv("NEUTRAIN_LOG_LEVEL", "verbose")
    assert main(["recipes"]) == 2
    errors = [call for call in writes.calls if "neutrain: error: " in call]
    assert len(errors) == 2 and all(call.startswith("neutrain: error: ") and call.endswith("\n") for call in errors), \
        writes.calls
    assert "\n" not in writes.calls  # no newline written on its own


@pytest.mark.parametrize("rank,printed", [("0", True), ("1", False)])
def test_a_launch_refusal_is_said_by_the_first_process_only(monkeypatch, capsys, rank, printed):
    # Before: each process of `accelerate launch --config_file launch/multi_gpu_ddp.yaml` on a CPU printed it.
    from neutrain.cli import preflight

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(preflight, "_cuda_available", lambda: False)
    monkeypatch.setattr("neutrain.cli.train._train_from_recipe",
                        lambda recipe, echo: preflight.check_launch(1, False, {"WORLD_SIZE": "2"}))
    assert main(["train", "default"]) == 2
    err = capsys.readouterr().err
    assert (err.count("neutrain: error: the launch started 2 processes") == 1) == printed, err
    assert printed or err == ""


@pytest.mark.parametrize("rank,printed", [("0", True), ("1", False)])
def test_under_torch_elastic_the_first_process_says_a_refusal_and_each_records_it(monkeypatch, capsys, tmp_path,
                                                                                  rank, printed):
    # Before: each process of `torchrun --nproc-per-node 2 -m neutrain <recipe with a bad key>` printed the line.
    import json

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    assert main(["train", "default", "train.max_steps=0"]) == 2
    err = capsys.readouterr().err
    line = "neutrain: error: train.max_steps: 0 trains nothing; give a number of steps > 0, or -1 to train train.num_epochs epochs"
    assert err == (line + "\n" if printed else "")
    recorded = json.loads((tmp_path / "error.json").read_text())
    assert recorded["message"]["message"] == line and recorded["neutrain_refusal"] == {"said": printed}


def test_processes_torchrun_starts_on_a_cpu_train_on_the_cpu():
    from neutrain.cli.preflight import cpu_processes

    torchrun = {"WORLD_SIZE": "2", "LOCAL_RANK": "1", "RANK": "1"}
    assert cpu_processes(torchrun, cuda_available=False)
    assert not cpu_processes(torchrun, cuda_available=True)  # GPUs: NCCL, as Accelerate picks
    assert not cpu_processes({**torchrun, "ACCELERATE_DYNAMO_BACKEND": "NO"}, cuda_available=False)  # a GPU config
    assert not cpu_processes({"WORLD_SIZE": "1", "LOCAL_RANK": "0"}, cuda_available=False)
