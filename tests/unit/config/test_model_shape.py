"""A model's shape read from the recipe's own numbers (``neutrain estimate`` without transformers) is the shape
the built config has, and every config the plain reader cannot vouch for goes to the config class as before."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from neutrain.config import RecipeError, load_recipe, validate_recipe
from neutrain.config.model_config import DERIVED_HEAD_DIM, plain_shape_config
from neutrain.config.sections import ModelSection
from neutrain.memory import ModelShape, config_only, shape_config
from tests.helpers import TINY_LLAMA, TINY_RECIPE, load_shipped_recipe

REPO = Path(__file__).resolve().parents[3]


def _model(config, tokenizer="byte", **keys):
    return ModelSection.model_construct(**{"config": config, "tokenizer": tokenizer, "tokenizer_vocab_size": 300,
                                           "base_model": None, "gguf_file": None, "trust_remote_code": False, **keys})


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_plan_with_the_shape_their_config_class_builds(path):
    recipe = load_shipped_recipe(path)
    if recipe is None or recipe.model.gguf_file:
        pytest.skip("a GGUF file's config is read by its own reader")
    assert plain_shape_config(recipe.model) is not None, "a shipped recipe's estimate would import transformers"
    assert ModelShape.from_config(shape_config(recipe.model)) == ModelShape.from_config(config_only(recipe.model))


@pytest.mark.parametrize("model_type", sorted(DERIVED_HEAD_DIM))
@pytest.mark.parametrize("extra", [{}, {"head_dim": 16}, {"vocab_size": 512}], ids=["derived", "head_dim", "vocab"])
@pytest.mark.parametrize("tokenizer", ["byte", "train-bpe", "gpt2"])
def test_each_architecture_read_plainly_matches_its_class(model_type, extra, tokenizer):
    model = _model({**TINY_LLAMA, "model_type": model_type, **extra}, tokenizer)
    if tokenizer == "gpt2" and "vocab_size" not in extra:  # the class's default vocabulary: its own to say
        assert plain_shape_config(model) is None
        return
    plain, built = ModelShape.from_config(plain_shape_config(model)), ModelShape.from_config(config_only(model))
    assert plain == built
    # The closed form counts what the build makes (Qwen2's q/k/v biases too), matrices and vectors alike.
    assert (plain.matrix_params(), plain.norm_params()) == (built.matrix_params(), built.norm_params())


def test_a_json_config_file_is_read_plainly_and_sized_to_the_tokenizer(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_LLAMA, "vocab_size": 512}))
    model = _model(str(path))
    assert plain_shape_config(model).vocab_size == 259  # a file's vocab_size gives way to the byte tokenizer's
    assert ModelShape.from_config(plain_shape_config(model)) == ModelShape.from_config(config_only(model))


def test_a_local_base_model_keeps_its_own_vocabulary(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY_LLAMA, "vocab_size": 512}))
    model = _model(None, None, base_model=str(tmp_path), init="pretrained")
    assert plain_shape_config(model).vocab_size == 512
    assert ModelShape.from_config(plain_shape_config(model)) == ModelShape.from_config(config_only(model))


@pytest.mark.parametrize("change", [
    {"model_type": "gemma"},  # its head_dim and vocabulary defaults are its own
    {"num_key_value_heads": None},  # a count the class fills in its own way
    {"hidden_size": 32.0},  # a float where the class wants an integer: its refusal
    {"tie_word_embeddings": "no"},
    {"num_attention_heads": 5},  # hidden_size 32 is not a multiple: the class refuses it
    {"num_key_value_heads": 3},
    {"head_dim": 0},
    {"vocab_size": 100},  # smaller than the tokenizer
], ids=str)
def test_configs_the_plain_reader_cannot_vouch_for_go_to_the_class(change):
    config = {k: v for k, v in {**TINY_LLAMA, **change}.items() if v is not None}
    assert plain_shape_config(_model(config, "gpt2")) is None


def test_a_hub_id_or_a_gguf_file_goes_to_transformers():
    assert plain_shape_config(_model(None, None, base_model="org/model")) is None
    assert plain_shape_config(_model(None, None, base_model=str(REPO), gguf_file="x.gguf")) is None


def _raw(**config):
    raw = copy.deepcopy(TINY_RECIPE)
    raw["model"]["config"] = {k: v for k, v in {**TINY_LLAMA, **config}.items() if v is not None}
    return raw


def test_a_shape_only_load_leaves_the_class_check_to_the_build_but_keeps_the_value_rules():
    typo = _raw(rms_norm_epz=1e-5)  # no number the shape reads: the estimate is right all the same
    with pytest.raises(RecipeError, match="unknown key 'rms_norm_epz' for LlamaConfig"):
        validate_recipe(copy.deepcopy(typo))
    assert validate_recipe(typo, shape_only=True).model.config["rms_norm_epz"] == 1e-5
    with pytest.raises(RecipeError, match=r"model\.config\.rope_theta: nan is not a finite number"):
        validate_recipe(_raw(rope_theta=float("nan")), shape_only=True)
    # A shape number misspelt leaves the shape unread: the class check runs and names it.
    with pytest.raises(RecipeError, match="unknown key 'num_hiden_layers' for LlamaConfig"):
        validate_recipe(_raw(num_hidden_layers=None, num_hiden_layers=4), shape_only=True)


def test_a_shape_only_load_of_a_shipped_recipe_is_the_full_load():
    assert load_recipe("llama3_8b", shape_only=True) == load_recipe("llama3_8b")


def test_the_class_checks_after_a_shape_only_load_refuse_as_the_full_load_and_keep_its_recipe():
    """``neutrain train`` checks the light recipe's classes instead of reading the file a second time."""
    from neutrain.config.validate import check_config_classes

    typo = _raw(rms_norm_epz=1e-5)
    with pytest.raises(RecipeError) as full:
        validate_recipe(copy.deepcopy(typo))
    with pytest.raises(RecipeError) as light:
        check_config_classes(validate_recipe(copy.deepcopy(typo), shape_only=True))
    assert str(light.value) == str(full.value)
    draft_typo = {**copy.deepcopy(TINY_RECIPE), "distill": {"draft_config": {"num_hiden_layers": 1}}}
    draft_typo["model"]["config"] = dict(TINY_LLAMA)
    with pytest.raises(RecipeError) as full:
        validate_recipe(copy.deepcopy(draft_typo))
    with pytest.raises(RecipeError) as light:
        check_config_classes(validate_recipe(copy.deepcopy(draft_typo), shape_only=True))
    assert str(light.value) == str(full.value)
    good = validate_recipe(_raw(), shape_only=True)
    check_config_classes(good)
    assert good == validate_recipe(_raw())
