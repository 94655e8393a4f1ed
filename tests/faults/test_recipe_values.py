"""Every value that comes in is checked where it comes in: each recipe key, each model-config value a build uses
(a recipe's, a foreign ``config.json``'s, a GGUF file's metadata), and each weight of a foreign model.

The checks are made once, from tables, so that a key added to the schema or a rule added to
``neutrain.config.model_values.RULES`` is checked by construction; the tests here walk the tables
(every key, every rule) and feed generated values (hypothesis), rather than a list of cases.
"""

from __future__ import annotations

import copy
import json
import math
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neutrain.cli import main
from neutrain.config import RecipeError, validate_recipe
from neutrain.config.schema import SCHEMA, Key
from neutrain.errors import CheckpointError
from tests.helpers import TINY_LLAMA, TINY_RECIPE, one_error_line, tiny_hf_folder, write_recipe

KEYS = [(section, name) for section, keys in SCHEMA.items() for name in keys]


def _recipe(tmp_path, section: str, name: str, value) -> dict:
    raw = copy.deepcopy(TINY_RECIPE)
    raw["train"]["output_dir"] = str(tmp_path / "out")
    raw.setdefault(section, {})[name] = value
    return raw


def _finite_everywhere(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, str):
        return "\0" not in value
    if isinstance(value, list):
        return all(_finite_everywhere(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _finite_everywhere(v) for k, v in value.items())
    return True


def _conforms(key: Key, value) -> bool:
    """Whether ``value`` keeps ``key``'s own declaration (type, choices, range, finite at every depth), computed
    apart from the validator: a value that does not must be refused naming its key."""
    if value is None:
        return key.nullable or key.default is None
    types = key.type if isinstance(key.type, tuple) else (key.type,)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    typed = any((t is float and number) or (t is int and isinstance(value, int) and not isinstance(value, bool))
                or (t not in (int, float) and isinstance(value, t)) for t in types)
    if not typed:
        return False
    if key.choices is not None and value not in key.choices:
        return False
    if number:
        if not math.isfinite(value) or (key.min is not None and value < key.min) or \
                (key.max is not None and value > key.max) or (key.gt is not None and not value > key.gt) or \
                (key.lt is not None and not value < key.lt):
            return False
    items = getattr(key, "items", None)
    if items is not None and isinstance(value, list) and not all(
            isinstance(v, items) and not isinstance(v, bool) for v in value):
        return False
    return _finite_everywhere(value)


# Values of every kind, including the ones no key takes: NaN, inf, 1e400 (inf once parsed), NUL, huge ints.
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from(["", "\0", "a\0b", "/dev/zero", "auto", "none", "nan", "-1", "1e400", "lora"]),
                    st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.one_of(st.text(max_size=6), st.integers()), inner, max_size=3)),
    max_leaves=6)


@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(key=st.sampled_from(KEYS), value=VALUES)
def test_any_value_of_any_key_is_taken_as_declared_or_refused_in_one_line_naming_the_key(tmp_path_factory, key, value):
    section, name = key
    tmp = tmp_path_factory.mktemp("r")
    try:
        recipe = validate_recipe(_recipe(tmp, section, name, value))
    except RecipeError as exc:
        text = str(exc)
        assert "\n" not in text
        if not _conforms(SCHEMA[section][name], value):
            assert text.startswith(f"{section}.{name}"), (section, name, value, text)
        return
    # Taken: then it keeps its declaration (a path is resolved, a budget word normalised: their type holds).
    assert _conforms(SCHEMA[section][name], value) or name == "device_budget_gib", (section, name, value)
    assert _finite_everywhere(getattr(getattr(recipe, section), name))


def _bad_values(key: Key) -> list:
    """For one key: a value of the wrong type, NaN, inf, and each side of its range, as its declaration says."""
    types = key.type if isinstance(key.type, tuple) else (key.type,)
    bad: list = [{"not": "this"}] if dict not in types else [[1.5]]
    if float in types or int in types:
        bad += [math.nan, math.inf]
        for bound, step in ((key.min, -1), (key.gt, 0), (key.max, 1), (key.lt, 0)):
            if bound is not None:
                bad.append(bound + step if int in types and float not in types else bound + step * 0.5 or bound)
    if list in types or dict in types:
        bad.append([math.nan] if list in types else {"x": math.nan})
    if getattr(key, "items", None) is not None:
        bad.append([7])
    if key.choices is not None:
        bad.append("not-a-choice")
    if key.path == "file":
        bad += ["/dev/zero", "/"]
    if key.path == "dir":
        bad.append("/dev/null")
    return bad


TABLE = [(s, n, v) for s, n in KEYS for v in _bad_values(SCHEMA[s][n]) if not _conforms(SCHEMA[s][n], v)]


@pytest.mark.parametrize("section,name,value", TABLE, ids=[f"{s}.{n}={v!r}" for s, n, v in TABLE])
def test_every_key_refuses_each_kind_of_bad_value_naming_itself(tmp_path, section, name, value):
    with pytest.raises(RecipeError) as info:
        validate_recipe(_recipe(tmp_path, section, name, value))
    assert str(info.value).startswith(f"{section}.{name}") and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("key,value,word", [
    ("train.fsdp_config", "/dev/zero", "is a character device, not a regular file"),
    ("train.deepspeed", "/dev/zero", "is a character device, not a regular file"),
    ("train.fsdp_config", "FIFO", "is a FIFO (named pipe), not a regular file"),
    ("train.deepspeed", "FIFO", "is a FIFO (named pipe), not a regular file"),
    ("model.config", "/dev/zero", "is a character device, not a regular file"),
    ("train.fsdp_config", "DIR", "is a directory, not a regular file"),
    ("train.resume_from_checkpoint", "/dev/null", "is a character device, not a directory"),
])
def test_a_path_key_names_the_kind_of_what_it_was_given(tmp_path, capsys, key, value, word):
    import os

    if value == "FIFO":
        value = str(tmp_path / "pipe")
        os.mkfifo(value)
    elif value == "DIR":
        value = str(tmp_path)
    assert main(["train", str(write_recipe(tmp_path)), f"{key}={value}"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"neutrain: error: {key}: ") and line.endswith(f"'{value}' {word}"), line


# ---- model-config values: one rule table for recipes, foreign config.json files and GGUF metadata -------------

def _config_keys() -> list[str]:
    """The keys of a few architectures' configs (and their rotary scaling's), where the rules' examples are found."""
    from transformers import CONFIG_MAPPING

    keys = {"factor", "beta_fast", "low_freq_factor", "attention_factor", "original_max_position_embeddings",
            "partial_rotary_factor"}
    for name in ("llama", "gemma2", "granite", "qwen2", "mixtral", "deepseek_v3", "gpt2", "phi3"):
        if name in CONFIG_MAPPING:
            keys |= set(CONFIG_MAPPING[name]().to_dict())
    return sorted(keys)


def _example_key(pattern: str) -> str:
    """A real config key the rule's pattern matches (each rule must match one: else it guards nothing)."""
    return next(name for name in _config_keys() if re.fullmatch(pattern, name))


def _breaking(kind: str) -> list:
    return {"size": [0, -1, 2.5, math.nan], "size0": [-1, 0.5],
            "epsilon": [0.0, -1e-5, 1.0, math.inf, math.nan, 1e-300],  # 1e-300 is 0 in float32
            "positive": [0.0, -10000.0, math.inf, math.nan], "probability": [-0.1, 1.5, math.nan],
            "fraction": [0.0, 1.5, 1e12, math.nan], "dtype": [1.5, -1, "x", True],
            "non-negative": [-0.02, math.nan], "boolean": ["yes", 1], "token": ["x", True, 1.5]}[kind]


def _rule_table() -> list[tuple[str, object]]:
    try:
        from neutrain.config.model_values import RULES
    except ImportError:  # no table to walk: the test below fails on its own import
        return [("rms_norm_eps", 0.0)]
    return [(_example_key(pattern), value) for pattern, kind, _ in RULES for value in _breaking(kind)]


RULE_TABLE = _rule_table()


@pytest.mark.parametrize("key,value", RULE_TABLE, ids=[f"{k}={v!r}" for k, v in RULE_TABLE])
def test_every_config_rule_refuses_its_bad_values_wherever_the_config_comes_from(key, value):
    from neutrain.config.model_values import check_config_values

    with pytest.raises(ValueError, match=rf"^where\.{key}: "):
        check_config_values({"model_type": "llama", key: value}, "where", ValueError)


@pytest.mark.parametrize("key,value", [("rms_norm_eps", 0.0), ("rope_theta", -1.0), ("hidden_size", 0),
                                       ("initializer_range", math.nan), ("attention_dropout", 2.0)])
def test_a_recipe_model_config_value_out_of_its_rule_is_refused_at_load(tmp_path, key, value):
    raw = _recipe(tmp_path, "model", "config", {**TINY_LLAMA, key: value})
    with pytest.raises(RecipeError, match=rf"^model\.config\.{key}: "):
        validate_recipe(raw)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny Hugging Face model folder with a tokenizer (the byte tokenizer)."""
    return tiny_hf_folder(tmp_path_factory.mktemp("hf"))


def _copy_with(folder, tmp_path, config: dict | None = None, weight: tuple[str, float] | None = None):
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path / "model"
    shutil.copytree(folder, out)
    if config:
        data = json.loads((out / "config.json").read_text())
        data.update(config)
        (out / "config.json").write_text(json.dumps(data))
    if weight:
        tensors = load_file(out / "model.safetensors")
        tensors[weight[0]][0] = weight[1]
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("change,said", [
    ({"config": {"rms_norm_eps": float("nan")}}, "config.rms_norm_eps: nan is not a finite number"),
    ({"config": {"rms_norm_eps": 0.0}}, "config.rms_norm_eps: 0.0 must be a finite number from 1.2e-38"),
    ({"config": {"num_hidden_layers": -2}}, "config.num_hidden_layers: -2 must be a whole number"),
    ({"weight": ("model.norm.weight", float("nan"))}, "tensor 'model.norm.weight' holds 1 NaN or infinite value(s)"),
    ({"weight": ("model.layers.1.input_layernorm.weight", float("inf"))},
     "tensor 'model.layers.1.input_layernorm.weight' holds 1 NaN or infinite value(s) (the first inf, at index 0)"),
])
def test_a_foreign_models_bad_config_value_or_non_finite_weight_is_refused_at_load_not_generated_from(
        tiny_folder, tmp_path, capsys, change, said):
    model = _copy_with(tiny_folder, tmp_path, **change)
    assert main(["generate", str(model), "--prompt", "hi", "--raw", "--max-new-tokens", "2"]) == 2
    captured = capsys.readouterr()
    line = one_error_line(captured.err)
    assert f"model '{model}': {said}" in line, line
    assert captured.out == ""  # nothing generated, not even a blank line


def test_a_weight_summing_past_float32_is_not_taken_for_a_non_finite_one():
    from neutrain.nn.load import check_finite

    check_finite("model 'm'", "w", torch.full((4,), 3e38))  # the sum overflows; every value is finite
    with pytest.raises(CheckpointError, match="the first -inf, at index 2"):
        check_finite("model 'm'", "w", torch.tensor([1.0, 2.0, -math.inf], dtype=torch.bfloat16))
