"""Faults in recipes and in the environment: one line on stderr, exit 2 (input) or 1 (environment), never a traceback.

Cases: non-finite / out-of-range values, settings used only after training, tracebacks from recipes and
from full or read-only disks, silently accepted unknown model.config keys and duplicate YAML keys,
and relative data paths.
Most cases run ``neutrain.cli.main`` in-process; two run ``python -m neutrain`` to prove
nothing but the one line reaches the terminal.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from neutrain.cli import main
from neutrain.config import RecipeError, load_recipe, validate_recipe
from neutrain.config.schema import SCHEMA
from tests.helpers import TINY_LLAMA, TINY_RECIPE, write_recipe

REPO = Path(__file__).resolve().parents[2]


def _error_line(capsys, argv: list[str], code: int, after_training: bool = False) -> str:
    """Run the CLI in-process; assert exit ``code``, no traceback and one ``neutrain: error:`` line on stderr.

    Before training that line is all of stderr; a run that trained first has also written its
    progress bars and log records there, and the error line must then be the last line.
    """
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == code, err
    assert "Traceback" not in err
    if after_training:
        assert [line for line in lines if "neutrain: error" in line] == lines[-1:], err
    else:
        assert len(lines) == 1, err
    assert lines[-1].startswith("neutrain: error: "), err
    return lines[-1]


@pytest.fixture
def nothing_built(monkeypatch):
    """Fail the test if the tokenizer or the model gets built: the error must come before."""
    import neutrain.trainer.modeling

    def built(*args, **kwargs):
        raise AssertionError("the model or tokenizer was built before the error")

    monkeypatch.setattr(neutrain.trainer.modeling, "build_model", built)
    monkeypatch.setattr(neutrain.trainer.modeling, "build_tokenizer", built)


# ---- class 6: non-finite and out-of-range values ------------------------------------------------------------

FLOAT_KEYS = [(s, n) for s, keys in SCHEMA.items() for n, k in keys.items()
              if k.type is float or (isinstance(k.type, tuple) and float in k.type)]


@pytest.mark.parametrize("section,name", FLOAT_KEYS, ids=[f"{s}.{n}" for s, n in FLOAT_KEYS])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_every_float_key_refuses_non_finite(section, name, bad):
    raw = yaml.safe_load(yaml.safe_dump(TINY_RECIPE))
    raw.setdefault(section, {})[name] = bad
    with pytest.raises(RecipeError, match=rf"^{section}\.{name}: -?inf is not a finite number$|^{section}\.{name}: nan is not a finite number$"):
        validate_recipe(raw)


@pytest.mark.parametrize("override,pattern", [
    ("train.learning_rate=nan", r"train\.learning_rate: nan is not a finite number"),
    ("train.learning_rate=.inf", r"train\.learning_rate: inf is not a finite number"),
    ("train.weight_decay=nan", r"train\.weight_decay: nan is not a finite number"),
    ("train.learning_rate=-1e-3", r"train\.learning_rate: -0\.001 must be greater than 0"),
    ("train.learning_rate=0", r"train\.learning_rate: 0\.0 must be greater than 0"),
    ("train.weight_decay=-0.1", r"train\.weight_decay: -0\.1 is below the minimum 0"),
    ("train.max_grad_norm=-1", r"train\.max_grad_norm: -1\.0 is below the minimum 0"),
    ("train.adam_beta2=1.0", r"train\.adam_beta2: 1\.0 must be less than 1"),
    ("train.num_epochs=0", r"train\.num_epochs: 0\.0 must be greater than 0"),
    ("train.seed=-1", r"train\.seed: -1 is below the minimum 0"),
    ("data.val_set_size=.nan", r"data\.val_set_size: nan is not a finite number"),
    ("memory.lora_dropout=1", r"memory\.lora_dropout: 1\.0 must be less than 1"),
    ("distill.temperature=inf", r"distill\.temperature: inf is not a finite number"),
    (("train.lr_scheduler=cosine", "train.lr_scheduler_kwargs={num_cycles: .nan}"), r"train\.lr_scheduler_kwargs\.num_cycles: nan is not a finite number"),
])
def test_non_finite_and_out_of_range_values_exit_2(tmp_path, capsys, override, pattern):
    overrides = [override] if isinstance(override, str) else list(override)
    line = _error_line(capsys, ["train", write_recipe(tmp_path), *overrides], 2)
    assert re.search(pattern, line), line


def test_nan_inside_model_config_is_refused(tmp_path, capsys):
    recipe = write_recipe(tmp_path, model={"config": {**TINY_LLAMA, "rope_theta": float("nan")}})
    assert "model.config.rope_theta: nan is not a finite number" in _error_line(capsys, [recipe], 2)


# ---- class 10: settings used after training are checked before the model is built ---------------------------

@pytest.mark.parametrize("sections,pattern", [
    ({"eval": {"long_context_tasks": ["niah_singel"]}},
     r"eval\.long_context_tasks\[0\]: unknown task 'niah_singel'\. Did you mean 'niah_single'\?"),
    ({"export": {"max_shard_size": "5 gigs"}}, r"export\.max_shard_size: '5 gigs' does not have the expected form"),
    ({"export": {"max_shard_size": "5GiB"}}, r"export\.max_shard_size: '5GiB'"),
    ({"train": {"lr_scheduler": "cosine_with_min_lr"}},
     r"train\.lr_scheduler_kwargs: cosine_with_min_lr needs exactly one of min_lr or min_lr_rate"),
    ({"train": {"lr_scheduler": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_ratio": 0.1}}},
     r"train\.lr_scheduler_kwargs\.min_lr_ratio: lr_scheduler cosine_with_min_lr takes num_cycles, min_lr, min_lr_rate\. Did you mean 'min_lr_rate'"),
    ({"train": {"lr_scheduler": "linear", "lr_scheduler_kwargs": {"num_cycles": 2}}},
     r"train\.lr_scheduler_kwargs\.num_cycles: lr_scheduler linear takes no options"),
    ({"train": {"distributed": "fsdp2"}}, r"train\.distributed: fsdp2 shards the model over several processes, but this launch started one"),
    ({"train": {"fsdp": "full_shard auto_wrap"}}, r"train\.fsdp: 'full_shard auto_wrap' shards the model over several processes"),
    ({"train": {"distributed": "fsdp2", "fsdp_config": "missing_fsdp.json"}},
     r"train\.fsdp_config: file 'missing_fsdp\.json' does not exist"),
    ({"train": {"report_to": "tensorbord"}}, r"train\.report_to: unknown logger 'tensorbord'\. Did you mean 'tensorboard'\?"),
    ({"train": {"resume_from_checkpoint": "runs/checkpoint-9"}},
     r"train\.resume_from_checkpoint: path 'runs/checkpoint-9' does not exist \(relative paths are looked up in the current directory"),
    ({"distill": {"enabled": True, "draft_config": {"num_hiden_layers": 1}}},
     r"distill\.draft_config: unknown key 'num_hiden_layers' for LlamaConfig\. Did you mean 'num_hidden_layers'\?"),
    ({"distill": {"enabled": True, "draft_config": {"num_attention_heads": 3}}},
     r"distill\.draft_config\.num_key_value_heads: 2 does not divide num_attention_heads 3"),
])
def test_late_settings_fail_before_the_model_is_built(tmp_path, capsys, nothing_built, sections, pattern):
    line = _error_line(capsys, ["train", write_recipe(tmp_path, **sections)], 2)
    assert re.search(pattern, line), line


def test_long_context_prompt_too_long_fails_before_the_model_is_built(tmp_path, capsys, monkeypatch):
    import neutrain.trainer.modeling

    def built(*args, **kwargs):
        raise AssertionError("the model was built before the error")

    monkeypatch.setattr(neutrain.trainer.modeling, "build_model", built)  # the tokenizer is needed: prompts count its tokens
    recipe = write_recipe(tmp_path, eval={"long_context_tasks": ["niah_single", "frequent_words"], "context_len": 512})
    line = _error_line(capsys, [recipe], 2)
    assert line.startswith("neutrain: error: eval.context_len: 512 tokens is too short for long-context task 'frequent_words'")


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_logger_that_is_not_installed_fails_before_the_model_is_built(tmp_path, capsys, nothing_built):
    line = _error_line(capsys, [write_recipe(tmp_path, train={"report_to": ["wandb"]})], 2)
    assert "train.report_to: 'wandb' is not installed" in line


def test_min_lr_schedule_kwargs_reach_the_trainer(tmp_path):
    from neutrain.cli.train import training_arguments

    recipe = load_recipe(write_recipe(tmp_path, train={"lr_scheduler": "cosine_with_min_lr",
                                                       "lr_scheduler_kwargs": {"min_lr_rate": 0.1}}))
    args = training_arguments(recipe, has_eval=False)
    assert args.lr_scheduler_kwargs == {"min_lr_rate": 0.1}


# ---- class 11 (recipes): one line, exit 2 -------------------------------------------------------------------

def _recipe_file(tmp_path: Path, content: bytes | str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


@pytest.mark.parametrize("content,overrides,pattern", [
    ("- train\n- data\n", [], r"r\.yaml: expected a mapping of sections .*, got list \['train', 'data'\]"),
    ("- train\n- data\n", ["train.max_steps=3"], r"r\.yaml: expected a mapping of sections .*, got list"),
    ("just words\n", ["train.max_steps=3"], r"r\.yaml: expected a mapping of sections .*, got str 'just words'"),
    (b"# r\xe9sum\xe9 of the run\ntrain:\n  max_steps: 3\n", [], r"r\.yaml is not UTF-8 text \(byte 0xe9 at line 1, offset 3\)"),
    ("train: 5\n", ["train.max_steps=3"], r"train: expected a mapping of keys, got int 5 \(so override 'train\.max_steps=3' has nowhere to go\)"),
    ("data:\n  datasets: [python-stdlib]\ntrain: 5\n", [], r"train: expected a mapping, got int"),
])
def test_malformed_recipe_files_exit_2(tmp_path, capsys, content, overrides, pattern):
    line = _error_line(capsys, ["train", _recipe_file(tmp_path, content), *overrides], 2)
    assert re.search(pattern, line), line


@pytest.mark.parametrize("sections,pattern", [
    ({"model": {"dtype": "float16"}, "train": {"optimizer": "lomo"}},
     r"model\.dtype: float16 weights cannot be trained by the fused optimizer lomo"),
    ({"model": {"config": {**TINY_LLAMA, "hidden_size": -1}}}, r"model\.config\.hidden_size: -1 must be a whole number from 1 to 2,147,483,647 \(a size or count\)"),
    ({"model": {"config": {**TINY_LLAMA, "hidden_size": "big"}}}, r"model\.config\.hidden_size: expected an integer, got str 'big'"),
    ({"model": {"config": {**TINY_LLAMA, "rms_norm_eps": "1e-5"}}},
     r"model\.config\.rms_norm_eps: expected a number, got str '1e-5' \(YAML reads 1e-5 without a dot as a string"),
    ({"model": {"config": {**TINY_LLAMA, "attention_dropout": 1.5}}}, r"model\.config\.attention_dropout: 1\.5 must be a finite number from 0 to below 1 \(a dropout probability\)"),
    ({"model": {"config": {**TINY_LLAMA, "num_attention_heads": 5}}}, r"model\.config\.num_key_value_heads: 2 does not divide num_attention_heads 5"),
    ({"model": {"config": {**TINY_LLAMA, "model_type": "lama"}}}, r"model\.config\.model_type: unknown model type 'lama'\. Did you mean 'llama'\?"),
])
def test_bad_model_and_precision_settings_exit_2(tmp_path, capsys, nothing_built, sections, pattern):
    line = _error_line(capsys, [write_recipe(tmp_path, **sections)], 2)
    assert re.search(pattern, line), line


def test_model_config_json_file_is_checked(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama", "hidden_size": 32,}')
    line = _error_line(capsys, [write_recipe(tmp_path, model={"config": str(config)})], 2)
    assert re.search(r"model\.config: file '.*config\.json' is not valid JSON \(.* at line 1, column \d+\)", line), line


# ---- class 12: unknown model.config keys and duplicate YAML keys ---------------------------------------------

def test_unknown_model_config_key_suggests_the_closest(tmp_path, capsys):
    config = {**TINY_LLAMA, "num_hiden_layers": 4}
    line = _error_line(capsys, [write_recipe(tmp_path, model={"config": config})], 2)
    assert "model.config: unknown key 'num_hiden_layers' for LlamaConfig. Did you mean 'num_hidden_layers'?" in line
    assert "model.allow_unknown_config_keys: true" in line


def test_unknown_model_config_key_is_kept_with_the_escape_hatch(tmp_path):
    from neutrain.trainer.modeling import config_only

    recipe = load_recipe(write_recipe(tmp_path, model={"config": {**TINY_LLAMA, "my_note": "kept"}, "allow_unknown_config_keys": True}))
    assert config_only(recipe.model).to_dict()["my_note"] == "kept"


def test_legacy_model_config_keys_are_not_unknown(tmp_path):
    config = {**TINY_LLAMA, "rope_theta": 10000.0, "torch_dtype": "float32", "architectures": ["LlamaForCausalLM"]}
    assert load_recipe(write_recipe(tmp_path, model={"config": config})).model.config["rope_theta"] == 10000.0


@pytest.mark.parametrize("text,pattern", [
    ("train:\n  learning_rate: 1e-3\n  max_steps: 2\n  learning_rate: 5e-3\n",
     r"r\.yaml: key 'learning_rate' appears twice \(lines 2 and 4\)"),
    ("train:\n  max_steps: 2\ndata:\n  sequence_len: 64\ntrain:\n  max_steps: 3\n", r"r\.yaml: key 'train' appears twice \(lines 1 and 5\)"),
])
def test_duplicate_yaml_keys_name_key_and_lines(tmp_path, capsys, text, pattern):
    line = _error_line(capsys, ["train", _recipe_file(tmp_path, text)], 2)
    assert re.search(pattern, line), line


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    raw = yaml.safe_load(yaml.safe_dump(TINY_RECIPE))
    text = yaml.safe_dump({k: v for k, v in raw.items() if k != "train"}, sort_keys=False)
    text += "base: &base\n  max_steps: 2\n  use_cpu: true\ntrain:\n  <<: *base\n  max_steps: 3\n"
    path = _recipe_file(tmp_path, text.replace("base: &base", "x-base: &base"))
    with pytest.raises(RecipeError, match="unknown section 'x-base'"):  # the anchor's section, not a duplicate
        load_recipe(path)


# ---- class 14 (part): a missing relative data path says what it was relative to ------------------------------

def test_missing_relative_data_path_names_both_places_looked(tmp_path, capsys, monkeypatch):
    recipe = write_recipe(tmp_path / "recipes", data={"datasets": [{"path": "data/train.jsonl", "type": "text"}]})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    line = _error_line(capsys, [recipe], 2)
    assert (f"data.datasets[0].path: data file 'data/train.jsonl' does not exist (relative paths are looked up in the "
            f"current directory {elsewhere}, then in the recipe's directory {(tmp_path / 'recipes').resolve()})") in line


def test_relative_data_path_found_beside_the_recipe(tmp_path, monkeypatch):
    recipe = write_recipe(tmp_path / "recipes", data={"datasets": [{"path": "data/train.jsonl", "type": "text"}]})
    (tmp_path / "recipes" / "data").mkdir()
    (tmp_path / "recipes" / "data" / "train.jsonl").write_text('{"text": "hello"}\n')
    monkeypatch.chdir(tmp_path)
    assert load_recipe(recipe).data.datasets[0]["path"] == str(tmp_path / "recipes" / "data" / "train.jsonl")


# ---- class 11 (environment): bad output_dir, read-only and full disks: one line, exit 1 -----------------------

def test_output_dir_that_is_a_file_exits_1(tmp_path, capsys, nothing_built):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    line = _error_line(capsys, [write_recipe(tmp_path, train={"output_dir": str(blocker)})], 1)
    assert line == f"neutrain: error: train.output_dir is not writable ({blocker}): Not a directory"


def test_output_dir_below_a_file_exits_1(tmp_path, capsys, nothing_built):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "run"
    line = _error_line(capsys, [write_recipe(tmp_path, train={"output_dir": str(out)})], 1)
    assert line == f"neutrain: error: train.output_dir is not writable ({out}): Not a directory"


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES, errno.ENOSPC])
def test_unwritable_output_dir_exits_1_before_the_model_is_built(tmp_path, capsys, monkeypatch, nothing_built, code):
    import neutrain.cli.preflight

    def refuse(*args, dir=None, **kwargs):  # what mkstemp meets on a read-only, forbidden or full file system
        raise OSError(code, os.strerror(code), os.path.join(dir, ".neutrain-write-probe-x"))

    monkeypatch.setattr(neutrain.cli.preflight.tempfile, "mkstemp", refuse)
    out = tmp_path / "out"
    line = _error_line(capsys, [write_recipe(tmp_path)], 1)
    assert line == f"neutrain: error: train.output_dir is not writable ({out}): {os.strerror(code)}"


def test_unwritable_export_dir_exits_1_before_training(tmp_path, capsys, nothing_built):
    (tmp_path / "file").write_text("x")
    line = _error_line(capsys, [write_recipe(tmp_path, export={"output_dir": str(tmp_path / "file" / "export")})], 1)
    assert line == f"neutrain: error: export.output_dir is not writable ({tmp_path / 'file'}): Not a directory"


RUN = {"max_steps": 1, "save_steps": 1, "logging_steps": 1}


def _safetensors_enospc(monkeypatch, where: str):
    """Make safetensors writes under ``where`` fail as a full disk makes them fail (SafetensorError, os error 28)."""
    import transformers.modeling_utils as mu
    from safetensors import SafetensorError

    original = mu.safe_save_file

    def save(tensors, filename, *args, **kwargs):
        if where in str(filename):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return original(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(mu, "safe_save_file", save)


def test_full_disk_while_writing_metrics_exits_1(tmp_path, capsys, monkeypatch):
    import builtins

    import neutrain.trainer.callbacks

    class FullDisk:  # a file whose write fails as on a full disk (plain writes carry no file name)
        def __init__(self, *args, **kwargs):
            self.fh = builtins.open(*args, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.fh, name)

    monkeypatch.setattr(neutrain.trainer.callbacks, "open", FullDisk, raising=False)
    recipe = write_recipe(tmp_path, train={**RUN, "save_steps": 100}, eval={"perplexity": False}, export={"format": "none"})
    line = _error_line(capsys, [recipe], 1, after_training=True)
    assert line == f"neutrain: error: disk full ({tmp_path / 'out'}): No space left on device"


def test_metrics_path_taken_by_a_directory_is_refused_before_training(tmp_path, capsys):
    recipe = write_recipe(tmp_path, train=RUN, eval={"perplexity": False}, export={"format": "none"})
    assert main([str(recipe)]) == 0  # the run, whose own metrics.jsonl is then replaced by a directory
    (tmp_path / "out" / "metrics.jsonl").unlink()
    (tmp_path / "out" / "metrics.jsonl").mkdir()
    capsys.readouterr()
    # Said before the resume trains (it was "Is a directory", exit 1, after the training): the run's own name.
    line = _error_line(capsys, [recipe, "train.resume_from_checkpoint=true", "train.max_steps=2"], 2)
    assert line == (f"neutrain: error: '{tmp_path / 'out' / 'metrics.jsonl'}' is a directory, where the run writes a "
                    "file; move it out of the run directory: nothing was written")
    assert not (tmp_path / "out" / "checkpoint-2").exists()


def test_full_disk_while_writing_a_checkpoint_exits_1(tmp_path, capsys, monkeypatch):
    _safetensors_enospc(monkeypatch, "checkpoint-1")
    recipe = write_recipe(tmp_path, train=RUN, eval={"perplexity": False}, export={"format": "none"})
    assert _error_line(capsys, [recipe], 1, after_training=True) == f"neutrain: error: disk full ({tmp_path / 'out'}): No space left on device"


def test_full_disk_while_exporting_exits_1(tmp_path, capsys, monkeypatch):
    _safetensors_enospc(monkeypatch, "export")
    recipe = write_recipe(tmp_path, train={**RUN, "save_steps": 100}, eval={"perplexity": False})
    assert _error_line(capsys, [recipe], 1, after_training=True) == f"neutrain: error: disk full ({tmp_path / 'out'}): No space left on device"


def test_torch_save_failure_on_a_full_disk_exits_1(tmp_path, capsys, monkeypatch):
    import shutil

    import torch

    original = torch.save
    free = [1 << 30]  # room at the start (the check before the first step passes); the disk fills during the run

    def save(obj, f, *args, **kwargs):  # torch's C++ writer reports a full disk without errno
        if str(f).endswith("optimizer.pt"):
            free[0] = 0
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return original(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 31, (1 << 31) - free[0], free[0]))
    recipe = write_recipe(tmp_path, train=RUN, eval={"perplexity": False}, export={"format": "none"})
    assert _error_line(capsys, [recipe], 1, after_training=True) == f"neutrain: error: disk full ({tmp_path / 'out'}): No space left on device"


# ---- the debug switch, and the terminal seen from outside ---------------------------------------------------

def _run(*args, **env):
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **env)
    return subprocess.run([sys.executable, "-m", "neutrain", *map(str, args)], capture_output=True, text=True, env=env, timeout=300)


def test_subprocess_recipe_error_is_one_line_and_debug_shows_traceback(tmp_path):
    recipe = write_recipe(tmp_path, train={"learning_rate": float("nan")})
    res = _run("train", recipe)
    assert res.returncode == 2 and res.stdout == "", res.stderr
    assert res.stderr.splitlines() == ["neutrain: error: train.learning_rate: nan is not a finite number"]
    debug = _run("train", recipe, NEUTRAIN_DEBUG="1")
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "RecipeError" in debug.stderr


def test_subprocess_environment_error_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    res = _run(write_recipe(tmp_path, train={"output_dir": str(tmp_path / "file")}))
    assert res.returncode == 1, res.stderr
    assert [line for line in res.stderr.splitlines() if line.strip()] == [
        f"neutrain: error: train.output_dir is not writable ({tmp_path / 'file'}): Not a directory"]


def test_help_documents_exit_codes_and_debug_switch(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "NEUTRAIN_DEBUG=1" in text and "exit 1 for the environment" in text


def test_weight_offload_without_the_host_memory_fails_before_the_model_is_built(tmp_path, capsys, monkeypatch,
                                                                                 nothing_built):
    import neutrain.cli.preflight
    import neutrain.cli.train

    monkeypatch.setattr(neutrain.cli.preflight, "host_memory_available", lambda: 32 << 30)
    # As on a GPU machine: on a CPU, `neutrain train` refuses weight offload first (it would save nothing there),
    # and a step predicted at hours on this CPU (the key lets it past that refusal, as a GPU would not need it).
    monkeypatch.setattr(neutrain.cli.train, "_cuda_available", lambda: True)
    out = tmp_path / "out"
    line = _error_line(capsys, ["train", REPO / "recipes" / "llama3_70b_offload.yaml", f"train.output_dir={out}",
                                "train.allow_slow_device=true"], 2)
    assert re.search(r"memory\.offload_weights: needs about 8\d\.\d GiB of host memory for the compressed decoder "
                     r"weights, but this machine has 32\.0 GiB available", line), line
    assert not out.exists()


def test_activation_offload_counts_its_host_bytes_too(tmp_path):
    from neutrain.cli.preflight import check_host_memory

    raw = yaml.safe_load((REPO / "recipes" / "llama3_8b.yaml").read_text())
    raw["model"]["config"]["max_position_embeddings"] = 32768  # rows of 32K tokens fit the model's positions
    (tmp_path / "long.yaml").write_text(yaml.safe_dump(raw))
    recipe = load_recipe(tmp_path / "long.yaml", ["memory.offload_activations=true", "data.sequence_len=32768",
                                                  f"train.output_dir={tmp_path}"])
    check_host_memory(recipe, available=8 << 30)  # 32 x 32K x 4096 x 2 bytes = 8 GiB: just fits
    with pytest.raises(RecipeError, match=r"memory\.offload_activations: needs about 8\.0 GiB of host memory for the "
                                          r"checkpointed activations, but this machine has 7\.9 GiB"):
        check_host_memory(recipe, available=(8 << 30) - (100 << 20))
    both = load_recipe(REPO / "recipes" / "llama3_70b_offload.yaml", ["memory.offload_activations=true",
                                                                      f"train.output_dir={tmp_path}"])
    with pytest.raises(RecipeError, match=r"memory\.offload_weights: needs about 108\.\d GiB of host memory \(8\d\.\d "
                                          r"GiB of compressed decoder weights and 20\.0 GiB of checkpointed activations\)"):
        check_host_memory(both, available=64 << 30)
    check_host_memory(recipe, available=None)  # unknown (not Linux): no refusal


def test_the_stated_host_memory_replaces_what_the_system_reports(tmp_path, monkeypatch):
    """A virtual machine that plugs memory in as it is used reports a fraction of its limit at first:
    ``NEUTRAIN_HOST_MEMORY_GIB`` states the limit, for the check and the plan alike (split over processes)."""
    import builtins

    from neutrain.cli.preflight import check_machine_holds, host_memory_available, host_memory_for
    from neutrain.errors import UserInputError

    real_open = builtins.open

    def small_meminfo(path, *args, **kwargs):  # what such a machine reads at start: 31 GiB
        if str(path) == "/proc/meminfo":
            import io
            return io.StringIO(f"MemTotal: {31 << 20} kB\nMemAvailable: {30 << 20} kB\n")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", small_meminfo)
    monkeypatch.delenv("NEUTRAIN_HOST_MEMORY_GIB", raising=False)
    assert host_memory_available() == 30 << 30 and host_memory_for(2) == (31 << 30) // 2
    recipe = load_recipe(REPO / "recipes" / "llama3_70b_offload.yaml", [f"train.output_dir={tmp_path}"])
    with pytest.raises(RecipeError, match=r"this machine has 30\.0 GiB available"):
        check_machine_holds(recipe)
    monkeypatch.setenv("NEUTRAIN_HOST_MEMORY_GIB", "240")
    assert host_memory_available() == 240 << 30 and host_memory_for(2) == 120 << 30
    check_machine_holds(recipe)
    monkeypatch.setenv("NEUTRAIN_HOST_MEMORY_GIB", "-1")
    with pytest.raises(UserInputError, match=r"NEUTRAIN_HOST_MEMORY_GIB='-1': out of range"):
        host_memory_available()
