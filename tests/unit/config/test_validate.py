import copy
from pathlib import Path

import pytest
import yaml

from neutrain.config import RecipeError, apply_overrides, load_recipe, validate_recipe
from tests.helpers import TINY_RECIPE, load_shipped_recipe

REPO = Path(__file__).resolve().parents[3]


def _raw():
    return copy.deepcopy(TINY_RECIPE)


def test_valid_recipe_fills_defaults():
    r = validate_recipe(_raw())
    assert r.train.gradient_accumulation_steps == 1
    assert r.data.datasets[0]["type"] == "text"
    assert r.memory.weights == "dense"


def test_unknown_key_names_it_and_suggests():
    raw = _raw()
    raw["train"]["learning_rat"] = 1e-4
    with pytest.raises(RecipeError, match=r"train: unknown key 'learning_rat'\. Did you mean 'learning_rate'\?"):
        validate_recipe(raw)


def test_unknown_section_suggests():
    raw = _raw()
    raw["trian"] = {}
    with pytest.raises(RecipeError, match=r"unknown section 'trian'.*'train'"):
        validate_recipe(raw)


@pytest.mark.parametrize(
    "section,key,value,pattern",
    [
        ("train", "micro_batch_size", "four", r"train\.micro_batch_size: expected an integer, got str"),
        ("train", "micro_batch_size", 0, r"train\.micro_batch_size: 0 is below the minimum 1"),
        ("train", "learning_rate", True, r"train\.learning_rate: expected a number"),
        ("train", "optimizer", "adamm", r"train\.optimizer: 'adamm' is not one of .* Did you mean 'adamw'"),
        ("data", "sample_packing", "yes please", r"data\.sample_packing: expected a boolean"),
    ],
)
def test_wrong_type_or_range_names_key(section, key, value, pattern):
    raw = _raw()
    raw[section][key] = value
    with pytest.raises(RecipeError, match=pattern):
        validate_recipe(raw)


def test_missing_data_file_names_path(tmp_path):
    raw = _raw()
    raw["data"]["datasets"] = [{"path": str(tmp_path / "nope.jsonl"), "type": "completion"}]
    with pytest.raises(RecipeError, match=r"data\.datasets\[0\]\.path: data file '.*nope\.jsonl' does not exist"):
        validate_recipe(raw)


def test_dataset_entry_unknown_key():
    raw = _raw()
    raw["data"]["datasets"][0]["typ"] = "text"
    with pytest.raises(RecipeError, match=r"data\.datasets\[0\]: unknown key 'typ'\. Did you mean 'type'"):
        validate_recipe(raw)


def test_float_accepts_yaml_string_exponent():
    raw = _raw()
    raw["train"]["learning_rate"] = "1e-5"  # YAML 1.1 reads 1e-5 without a dot as a string
    assert validate_recipe(raw).train.learning_rate == 1e-5


def test_overrides_parse_values_and_reject_bad_syntax():
    raw = apply_overrides(_raw(), ["train.learning_rate=1e-5", "data.sample_packing=false", "train.max_steps=7"])
    r = validate_recipe(raw)
    assert r.train.learning_rate == 1e-5 and r.data.sample_packing is False and r.train.max_steps == 7
    with pytest.raises(RecipeError, match="expected section.key=value"):
        apply_overrides(_raw(), ["train.learning_rate"])
    with pytest.raises(RecipeError, match="unknown section 'tran'"):
        apply_overrides(_raw(), ["tran.x=1"])


def test_cross_checks():
    raw = _raw()
    raw["data"]["streaming"] = True
    raw["train"]["max_steps"] = -1
    with pytest.raises(RecipeError, match=r"train\.max_steps: must be > 0 when data\.streaming"):
        validate_recipe(raw)
    raw = _raw()
    raw["model"] = {"init": "pretrained"}
    with pytest.raises(RecipeError, match=r"model\.base_model: required"):
        validate_recipe(raw)
    raw = _raw()
    raw.setdefault("memory", {})["offload_activations"] = True
    with pytest.raises(RecipeError, match=r"memory\.offload_activations: needs memory\.gradient_checkpointing"):
        validate_recipe(raw)
    raw["memory"]["gradient_checkpointing"] = True
    assert validate_recipe(raw).memory.offload_activations is True


@pytest.mark.parametrize("value, pattern", [
    (True, r"memory\.offload_layers: expected an integer, got bool True"),
    (2.5, r"memory\.offload_layers: expected an integer, got float 2\.5"),
    (0, r"memory\.offload_layers: 0 is below the minimum 1"),
])
def test_offload_layers_is_a_count_of_layers(value, pattern):
    raw = _raw()
    raw.setdefault("memory", {}).update(weights="neuzip-lossless", offload_weights=True, offload_layers=value)
    raw["train"]["optimizer"] = "lomo"
    with pytest.raises(RecipeError, match=pattern):
        validate_recipe(raw)
    raw["memory"]["offload_layers"] = 3
    assert validate_recipe(raw).memory.offload_layers == 3
    # A count of layers means nothing without weight offload: one line naming both keys.
    raw["memory"]["offload_weights"] = False
    with pytest.raises(RecipeError, match=r"^memory\.offload_layers: 3 layers in host memory needs "
                                          r"memory\.offload_weights: true$"):
        validate_recipe(raw)


def test_shipped_recipes_validate():
    recipes = sorted((REPO / "recipes").glob("*.yaml"))
    assert recipes, "no shipped recipes"
    for path in recipes:
        first = path.read_text().splitlines()[0]
        assert first.startswith("#!"), f"{path.name}: first line must be a shebang"
        load_shipped_recipe(path)  # a recipe of an optional package's model: validated where it is installed


def test_invalid_yaml_reports_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("train:\n  learning_rate: [1,\n")
    with pytest.raises(RecipeError, match=r"bad\.yaml: line \d+"):
        load_recipe(p)
    assert yaml  # the module parses YAML through PyYAML
