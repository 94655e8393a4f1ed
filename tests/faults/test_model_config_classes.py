"""``model.config`` values are checked by class: every value of the wrong type names ``model.config.<key>`` and the
type its config class declares; every structured value (rotary scaling) is a mapping of a known kind or null; and
the run feeds the model no more positions than its config has.

Why: ``layer_types: full`` was refused in transformers' words ("Qwen2Config refuses these values: Validation
error for field 'layer_types': TypeError: ... doesn't match any type in (list[str], <class 'NoneType'>)"),
``rope_scaling: ""`` trained unscaled with exit 0, and a ``data.sequence_len`` past ``max_position_embeddings``
trained in silence. The oracle of the type table is the config class itself: every value it refuses for a
field's declared type must be one line naming that key.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from tests.helpers import TINY_LLAMA, one_error_line, tiny_hf_folder, write_recipe

ARCHITECTURES = ("llama", "qwen2", "gemma3_text", "gpt2", "mistral")
WRONG = ("x", "", 5, 1.5, True, [1], ["a"], {"a": 1}, [])


def _class_refuses(cls, key, value) -> bool:
    """Whether ``cls`` refuses ``value`` for the type it declares for field ``key`` (not its relations)."""
    from huggingface_hub.errors import StrictDataclassFieldValidationError

    try:
        cls(**{key: value})
    except StrictDataclassFieldValidationError as exc:
        return f"'{key}'" in str(exc)
    except Exception:  # noqa: BLE001 (the class's other checks: not a type's)
        return False
    return False


def _fields(model_type: str) -> list[str]:
    import dataclasses

    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    return [f.name for f in dataclasses.fields(cls) if f.name not in ("transformers_version", "model_type")]


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_every_value_of_a_wrong_type_names_its_key_and_the_type(model_type):
    from transformers import CONFIG_MAPPING

    from neutrain.config.model_config import check_model_config
    from neutrain.errors import RecipeError

    cls, checked = CONFIG_MAPPING[model_type], 0
    for key in _fields(model_type):
        for value in WRONG:
            if not _class_refuses(cls, key, value):
                continue
            checked += 1
            with pytest.raises(RecipeError) as caught:
                check_model_config({"model_type": model_type, key: value})
            line = str(caught.value)
            assert line.startswith(f"model.config.{key}") and "\n" not in line, (key, value, line)
            assert "refuses these values" not in line, line
    assert checked > 20


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(_fields("qwen2")),
       st.one_of(st.text(max_size=4), st.integers(-3, 3), st.floats(allow_nan=False), st.booleans(),
                 st.lists(st.one_of(st.integers(0, 2), st.text(max_size=2)), max_size=3),
                 st.dictionaries(st.text(max_size=2), st.integers(0, 2), max_size=2)))
def test_generated_values_the_class_refuses_name_the_key(key, value):
    from transformers import CONFIG_MAPPING

    from neutrain.config.model_config import check_model_config
    from neutrain.errors import RecipeError

    if not _class_refuses(CONFIG_MAPPING["qwen2"], key, value):
        return
    with pytest.raises(RecipeError) as caught:
        check_model_config({"model_type": "qwen2", key: value})
    assert str(caught.value).startswith(f"model.config.{key}"), str(caught.value)


ROTARY_BAD = ["", "linear", 0, 2.0, True, [], ["linear"], {}, {"factor": 2.0}, {"rope_type": ""},
              {"rope_type": None}, {"rope_type": "bogus", "factor": 2.0}, {"type": "liner", "factor": 2.0}]


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("value", ROTARY_BAD, ids=repr)
def test_a_rotary_scaling_that_is_not_a_known_kind_is_refused_naming_the_key(key, value):
    from neutrain.config.model_config import check_model_config
    from neutrain.errors import RecipeError

    with pytest.raises(RecipeError) as caught:
        check_model_config({"model_type": "llama", key: value})
    assert str(caught.value).startswith(f"model.config.{key}"), str(caught.value)


@pytest.mark.parametrize("value", ["", [], {}, {"factor": 2.0}])
def test_a_foreign_config_with_a_bad_rotary_scaling_is_refused_naming_the_file(value):
    from neutrain.config.model_values import check_config_values
    from neutrain.errors import CheckpointError

    with pytest.raises(CheckpointError) as caught:
        check_config_values({"rope_scaling": value, "hidden_size": 64}, "model 'm': config", CheckpointError)
    assert str(caught.value).startswith("model 'm': config.rope_scaling"), str(caught.value)


def test_a_wrong_type_through_the_command_is_one_line_exit_2(tmp_path, capsys):
    from neutrain.cli import main

    recipe = write_recipe(tmp_path, model={"config": {**TINY_LLAMA, "model_type": "qwen2", "layer_types": "full"}})
    assert main(["train", str(recipe)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "model.config.layer_types" in line and "list" in line, line
    assert not (tmp_path / "out").exists()


def _sources(tmp_path):
    """Each way a recipe gives the model's positions: inline, a base model's config.json, the class's default."""
    folder = tiny_hf_folder(tmp_path / "base")
    small = json.loads((folder / "config.json").read_text())
    small["max_position_embeddings"] = 64
    (folder / "config.json").write_text(json.dumps(small))
    no_key = {k: v for k, v in TINY_LLAMA.items() if k != "max_position_embeddings"}
    return {
        "inline": ({"config": {**TINY_LLAMA, "max_position_embeddings": 64}}, 64, "model.config.max_position_embeddings"),
        "base model": ({"init": "pretrained", "base_model": str(folder), "config": None, "tokenizer": None}, 64,
                       "max_position_embeddings"),
        "class default": ({"config": no_key}, 2048, "max_position_embeddings"),
    }


@pytest.mark.parametrize("source", ["inline", "base model", "class default"])
@pytest.mark.parametrize("use", ["data.sequence_len", "eval.context_len"])
def test_a_run_past_the_models_positions_is_refused_naming_both_keys(tmp_path, capsys, source, use):
    from neutrain.cli import main

    model, positions, named = _sources(tmp_path)[source]
    sections, tokens = {"model": model}, max(positions * 2, 1024)  # a long-context prompt needs some room
    if use == "data.sequence_len":
        sections["data"] = {"sequence_len": tokens}
    else:
        sections["eval"] = {"long_context_tasks": ["niah_single"], "context_len": tokens}
    recipe = write_recipe(tmp_path, **sections)
    assert main(["train", str(recipe), "train.max_steps=1"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert use in line and named in line and f"{tokens:,}" in line and f"{positions:,}" in line, line
    assert not list((tmp_path / "out").glob("checkpoint-*"))
