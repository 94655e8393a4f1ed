"""Values that pass their own type check but not the run: counts without a ceiling, model-config values that
contradict each other or name nothing transformers has, JSON's non-numbers, data files that are not files.

Each was found by trying a variant of a case already closed: ``data.num_proc: 1e20`` forked workers until the
machine's process table was full; ``model.config.hidden_act: banana`` and an unknown ``rope_type`` ended in a
bare ``KeyError`` from the model's constructor; ``num_key_value_heads`` not dividing ``num_attention_heads``, or
an odd rotary width, in a tensor-shape ``RuntimeError`` of the first forward; ``NaN`` in a config JSON was read
as a number; a FIFO named ``x.jsonl`` in a data directory was skipped in silence. Each is now one line naming
the key or the file, refused before anything runs.
"""

from __future__ import annotations

import copy
import json
import os
import re

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from neutrain.config import load_recipe
from neutrain.config.model_values import check_config_values
from neutrain.config.schema import SCHEMA
from neutrain.errors import DataError, RecipeError, UserInputError
from neutrain.files import read_json_object
from tests.helpers import TINY_LLAMA, TINY_RECIPE, one_error_line

NUMERIC = sorted(f"{section}.{name}" for section, keys in SCHEMA.items() for name, key in keys.items()
                 if key.type in (int, float) or (isinstance(key.type, tuple) and int in key.type and str not in key.type))


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("recipe")
    raw = copy.deepcopy(TINY_RECIPE)
    raw["train"]["output_dir"] = str(folder / "out")
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("key", NUMERIC)
def test_every_numeric_key_has_a_ceiling(recipe, key):
    """No whole number past int32 is a setting: each key refuses it by name, whatever its own maximum."""
    with pytest.raises(RecipeError, match="^" + re.escape(key) + ": .*(maximum|finite|expected|less than)"):
        load_recipe(recipe, [f"{key}=99999999999999999999"])


@pytest.mark.parametrize("key,value", [("data.num_proc", 100_000), ("train.dataloader_num_workers", 100_000),
                                       ("train.micro_batch_size", 10**7), ("eval.micro_batch_size", 10**7),
                                       ("train.gradient_accumulation_steps", 10**9), ("train.num_epochs", 1e300)])
def test_keys_that_cost_a_process_or_a_row_each_are_bounded_by_a_machine(recipe, key, value):
    with pytest.raises(RecipeError, match="^" + re.escape(key) + ": .* is above the maximum"):
        load_recipe(recipe, [f"{key}={value}"])


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(NUMERIC), st.one_of(st.integers(min_value=-2**70, max_value=2**70),
                                           st.floats(allow_nan=True, allow_infinity=True)))
def test_any_number_for_any_key_is_taken_within_bounds_or_refused_in_one_line(recipe, key, value):
    try:
        loaded = load_recipe(recipe, [f"{key}={yaml.safe_dump(value).splitlines()[0]}"])
    except UserInputError as exc:
        assert "\n" not in str(exc) and str(exc).startswith(key), str(exc)
        return
    section, name = key.split(".")
    got = getattr(getattr(loaded, section), name)
    if isinstance(got, (int, float)) and not isinstance(got, bool):
        assert abs(got) <= 2**31 - 1, (key, value, got)


# (values, the message's start): each set of values keeps every key's own rule and breaks a relation.
RELATIONS = [
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, "model.config.num_key_value_heads: 3 does not divide"),
    ({"hidden_size": 32, "num_attention_heads": 4, "head_dim": 3, "rope_theta": 1e4},
     "model.config.head_dim: a head 3 wide rotates 3 dimensions"),
    ({"hidden_size": 36, "num_attention_heads": 4, "rope_parameters": {"rope_theta": 1e4}},
     "model.config.hidden_size: a head 9 wide"),
    ({"vocab_size": 100, "eos_token_id": 100}, "model.config.eos_token_id: 100 is not a token of the vocabulary"),
    ({"vocab_size": 100, "eos_token_id": [1, 2, 500]}, "model.config.eos_token_id: 500 is not a token"),
    ({"bos_token_id": -5}, "model.config.bos_token_id: -5 is not a token"),
    ({"pad_token_id": -2}, "model.config.pad_token_id: -2 is not a token"),
    ({"attention_dropout": 1.0}, "model.config.attention_dropout: 1.0 must be a finite number from 0 to below 1"),
]


@pytest.mark.parametrize("values,start", RELATIONS, ids=[start.split(":")[0] for _, start in RELATIONS])
def test_model_config_values_that_contradict_each_other_are_refused(values, start):
    with pytest.raises(RecipeError) as caught:
        check_config_values(values, "model.config", RecipeError)
    assert str(caught.value).startswith(start) and "\n" not in str(caught.value), str(caught.value)


def test_consistent_configs_pass_the_relations():
    check_config_values({**TINY_LLAMA, "vocab_size": 259, "bos_token_id": 1, "eos_token_id": [2, 3],
                         "pad_token_id": -1, "partial_rotary_factor": 0.5, "rope_theta": 1e4}, "model.config", RecipeError)


@pytest.mark.parametrize("key,value,start", [
    ("hidden_act", "banana", "model.config.hidden_act: 'banana' is not an activation"),
    ("rope_scaling", {"rope_type": "banana", "factor": 2.0}, "model.config.rope_parameters.rope_type: 'banana'"),
])
def test_names_transformers_has_no_function_for_are_refused_before_the_build(key, value, start):
    from transformers import LlamaConfig

    from neutrain.nn.load import check_config_names

    with pytest.raises(RecipeError) as caught:
        check_config_names(LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}, **{key: value}),
                           "model.config", RecipeError)
    assert str(caught.value).startswith(start), str(caught.value)


@pytest.mark.slow
def test_an_unknown_activation_is_one_line_from_the_command(tmp_path, capsys):
    from neutrain.cli import main

    raw = copy.deepcopy(TINY_RECIPE)
    raw["model"]["config"] = {**TINY_LLAMA, "hidden_act": "banana"}
    raw["train"].update(output_dir=str(tmp_path / "out"), max_steps=1)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["train", str(path)]) == 2
    assert "model.config.hidden_act: 'banana'" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("word", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("label", ["train.fsdp_config", "train.deepspeed", "model.config"])
def test_json_configs_refuse_non_numbers(tmp_path, word, label):
    path = tmp_path / "c.json"
    path.write_text('{\n  "fsdp_version": 2,\n  "x": ' + word + "\n}")
    with pytest.raises(RecipeError) as caught:
        read_json_object(path, f"{label}: file '{path}'", RecipeError)
    assert str(caught.value) == f"{label}: file '{path}' holds {word} (line 3): not valid JSON, and no finite number"


def test_a_model_config_file_with_nan_is_refused_at_load(recipe, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA)[:-1] + ', "rms_norm_eps": NaN}')
    with pytest.raises(RecipeError, match=r"holds NaN \(line 1\)"):
        load_recipe(recipe, [f"model.config={path}"])


def _fifo(path):
    os.mkfifo(path)


def _dangling(path):
    os.symlink(path.parent / "gone.jsonl", path)


@pytest.mark.parametrize("make,word", [(_fifo, "a FIFO"), (_dangling, "does not exist")], ids=["fifo", "dangling"])
def test_a_data_directory_holding_a_data_name_that_is_no_file_is_refused(tmp_path, make, word):
    from neutrain.data.sources import entry_files

    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"text": "hello"}\n')
    make(folder / "b.jsonl")
    with pytest.raises(DataError) as caught:
        entry_files({"path": str(folder), "type": "text"})
    assert f"{folder / 'b.jsonl'}" in str(caught.value) and word in str(caught.value), str(caught.value)


@pytest.mark.parametrize("make,word", [
    (lambda p: os.mkfifo(p), "is a FIFO (named pipe), not a regular file"),
    (lambda p: p.mkdir(), "is a directory, not a regular file"),
    (lambda p: p.symlink_to("/dev/zero"), "is a character device, not a regular file"),
    (lambda p: p.write_text('{"prompt": "a\\ud800"}\n'), "line 1: key 'prompt' holds a lone surrogate"),
    (lambda p: p.write_text('{"prompt": "a", "temperature": NaN}\n'), "line 1 holds NaN"),
    (lambda p: p.write_bytes(b'{"prompt": "caf\xe9"}\n'), "is not UTF-8 text"),
], ids=["fifo", "directory", "device", "surrogate", "nan", "latin-1"])
def test_generate_input_file_goes_through_the_one_reader(tmp_path, make, word):
    from neutrain.cli.generate import read_prompts

    path = tmp_path / "prompts.jsonl"
    make(path)
    with pytest.raises(UserInputError) as caught:
        read_prompts(str(path))
    assert str(caught.value).startswith(f"--input-file: '{path}'") and word in str(caught.value), str(caught.value)
