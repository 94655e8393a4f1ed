"""A recipe's YAML holds JSON's types only, read one way in a recipe file and in a ``section.key=value`` override:
decimal numbers (YAML 1.1's ``1:30`` = 90, ``010`` = 8, ``1_0``, ``0x10``, ``0b11`` are not numbers here: every other
reader of neutrain's numbers refuses them), no date, bytes or set at any depth (a date inside ``model.config`` trained
and then failed in a ``TypeError`` traceback writing ``config.json``), no key twice in one mapping, on one line or
two, and no alias bomb, in a file or an override (one given as an override hung the load)."""

from __future__ import annotations

import copy
import datetime
import time

import pytest
import yaml

from neutrain.config.recipe_yaml import parse_recipe_text
from neutrain.config.validate import apply_overrides, load_recipe, section_from, validate_recipe
from neutrain.errors import RecipeError
from tests.faults.test_recipe_ranges import NUMERIC
from tests.helpers import TINY_RECIPE

# Each is a number to YAML 1.1 (so to PyYAML) and to no other reader of neutrain's: refused, whatever the key.
NOT_DECIMAL = ["1_0", "0x10", "0b11", "1:30", "-1:30", "1_0.5", "10:00.5", "!!int 0x10", "!!float 1:30", "!!int 1_0",
               "!!float 0x10", "!!int 0o17"]
# Types JSON has none of; the run writes its recipe and configs as JSON.
NOT_JSON = ["!!binary aGk=", "!!set {x}", "!!timestamp 2024-01-01", "!!omap [a: 1]", "!!pairs [a: 1]"]
# Places a value may sit at any depth: (section, key, the YAML of a mapping or list holding VALUE).
DEPTHS = [("train", "fsdp_config", "{a: VALUE}"), ("train", "fsdp_config", "{a: {b: [1, VALUE]}}"),
          ("train", "lr_scheduler_kwargs", "{num_cycles: VALUE}"), ("model", "config", "CONFIG"),
          ("data", "datasets", "[{path: python-stdlib, type: text, max_files: VALUE}]")]


def _recipe_text(section: str, key: str, value_yaml: str, tmp_path) -> str:
    """The tiny recipe as YAML, with ``section.key`` written as ``value_yaml`` (text, so that YAML reads it)."""
    raw = copy.deepcopy(TINY_RECIPE)
    raw["train"]["output_dir"] = str(tmp_path / "out")
    raw["model"]["allow_unknown_config_keys"] = True
    raw.setdefault(section, {})[key] = "PLACEHOLDER"
    return yaml.safe_dump(raw, sort_keys=False).replace("PLACEHOLDER", value_yaml)


def _config(value: str) -> str:
    return "{" + ", ".join(f"{k}: {yaml.safe_dump(v).strip()}" for k, v in TINY_RECIPE["model"]["config"].items()) + \
        f", made_on: {value}}}"


def _load(text: str, tmp_path, overrides=()):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return load_recipe(path, overrides, shape_only=True)


def _refused_in_one_line(call, *names: str) -> str:
    with pytest.raises(RecipeError) as caught:
        call()
    text = str(caught.value)
    assert "\n" not in text and text.startswith(names), (names, text)
    return text


def test_every_numeric_key_refuses_a_number_written_other_than_in_decimal(tmp_path):
    # Every key meets every form over the two routes: the forms are cycled over the keys, one load a key and route.
    for i, (section, key) in enumerate(NUMERIC):
        form = NOT_DECIMAL[i % len(NOT_DECIMAL)]
        text = _recipe_text(section, key, form, tmp_path)
        _refused_in_one_line(lambda: _load(text, tmp_path), f"{section}.{key}:", str(tmp_path / "r.yaml"))
        form = NOT_DECIMAL[(i + 5) % len(NOT_DECIMAL)]
        plain = _recipe_text("train", "seed", "1", tmp_path)
        _refused_in_one_line(lambda: _load(plain, tmp_path, [f"{section}.{key}={form}"]), f"{section}.{key}:")


# Forms read as numbers, in decimal; and forms YAML 1.1 itself reads as text (kept so: PyYAML's dumper writes such a
# string unquoted in the run's recipe.yaml, which must read back the same).
DECIMAL = {"010": 10, "+12": 12, "-0": 0, "007": 7, "1.5e-3": 0.0015, ".5": 0.5, "00.25": 0.25, "1.": 1.0,
           "-2.5e+2": -250.0}
TEXT = ["1e3", "09", "1.0e5", "2024-01-01", "12:30:00"]


@pytest.mark.parametrize("form", NOT_DECIMAL + list(DECIMAL) + TEXT)
def test_a_yaml_number_is_read_in_decimal_or_is_text(form):
    # The loader itself, each form in the places a value takes: a mapping's value, a list's item, a flow mapping.
    for document, pick in ((f"k: {form}", lambda v: v["k"]), (f"- {form}", lambda v: v[0]),
                           (f"{{a: [{form}]}}", lambda v: v["a"][0])):
        try:
            value = pick(parse_recipe_text(document.encode(), "r.yaml"))
        except RecipeError as exc:
            assert form.startswith("!!") and str(exc).startswith("r.yaml:") and "\n" not in str(exc), (form, exc)
            continue
        assert not form.startswith("!!"), (form, value)
        assert value == DECIMAL.get(form, form) and type(value) is type(DECIMAL.get(form, form)), (form, value)
        assert parse_recipe_text(yaml.safe_dump({"k": form}).encode(), "r.yaml") == {"k": form}  # written back


@pytest.mark.parametrize("section,key,holder", DEPTHS)
def test_a_value_of_a_type_json_lacks_is_refused_at_any_depth_in_a_file_and_an_override(tmp_path, section, key,
                                                                                       holder):
    for value in NOT_JSON:
        nested = _config(value) if holder == "CONFIG" else holder.replace("VALUE", value)
        text = _recipe_text(section, key, nested, tmp_path)
        _refused_in_one_line(lambda: _load(text, tmp_path), str(tmp_path / "r.yaml"))
        plain = _recipe_text("train", "seed", "1", tmp_path)
        refused = _refused_in_one_line(lambda: _load(plain, tmp_path, [f"{section}.{key}={nested}"]),
                                       f"{section}.{key}")
        assert "Traceback" not in refused


# The same places, in a recipe built in Python: (key, how VALUE is put there).
PYTHON_DEPTHS = [("train.fsdp_config", lambda raw, v: raw["train"].update(fsdp_config={"a": v})),
                 ("train.fsdp_config", lambda raw, v: raw["train"].update(fsdp_config={"a": {"b": [1, v]}})),
                 ("train.lr_scheduler_kwargs", lambda raw, v: raw["train"].update(lr_scheduler_kwargs={"num_cycles": v})),
                 ("model.config", lambda raw, v: raw["model"]["config"].update(made_on=v)),
                 ("data.datasets", lambda raw, v: raw["data"]["datasets"][0].update(max_files=v))]


@pytest.mark.parametrize("key,put", PYTHON_DEPTHS)
def test_a_python_value_of_a_type_json_lacks_is_refused_at_any_depth_naming_its_key(key, put):
    # validate_recipe and section_from take recipes built in Python, where no YAML loader ran.
    for value in (datetime.date(2024, 1, 1), b"hi", {"x"}, frozenset(), datetime.datetime(2024, 1, 1), 1j):
        raw = copy.deepcopy(TINY_RECIPE)
        raw["model"]["allow_unknown_config_keys"] = True
        put(raw, value)
        _refused_in_one_line(lambda: validate_recipe(raw, shape_only=True), key)
    with pytest.raises(RecipeError, match=r"^train\.fsdp_config\.a: .* of type date"):
        section_from("train", {"fsdp_config": {"a": datetime.date(2024, 1, 1)}})


def test_a_date_a_recipe_writes_without_quotes_is_text():
    assert parse_recipe_text(b"train:\n  output_dir: 2024-01-01\n", "r.yaml") == {"train": {"output_dir": "2024-01-01"}}
    assert apply_overrides({}, ["train.output_dir=2024-01-01 10:00:00"])["train"]["output_dir"] == "2024-01-01 10:00:00"


@pytest.mark.parametrize("document", ["train: {max_steps: 3, max_steps: 5}", "{train: {}, train: {}}",
                                      "train:\n  lr_scheduler_kwargs: {a: 1, 'a': 2}", "k: {1: a, 1.0: b}",
                                      "k: {true: a, yes: b}", "k: [{a: 1, b: 2, a: 3}]", "? a\n: 1\n? a\n: 2",
                                      "train:\n  max_steps: 3\n  max_steps: 5"])
def test_a_key_twice_in_one_mapping_is_refused_on_one_line_or_two(document):
    _refused_in_one_line(lambda: parse_recipe_text(document.encode(), "r.yaml"), "r.yaml: key ")
    flow = document.split(":", 1)[1].strip() if document.startswith(("train: {", "k: ")) else None
    if flow is not None:
        _refused_in_one_line(lambda: apply_overrides({}, [f"train.fsdp_config={flow}"]),
                             "override 'train.fsdp_config': key ")


def test_merged_keys_may_still_be_overridden():
    document = b"base: &b {x: 1, y: 2}\nuse: {<<: *b, x: 3}\nmore: {<<: [*b], y: 4}\n"
    assert parse_recipe_text(document, "r.yaml") == {"base": {"x": 1, "y": 2}, "use": {"x": 3, "y": 2},
                                                     "more": {"x": 1, "y": 4}}


def test_an_alias_bomb_in_an_override_is_refused_at_once():
    levels = ["&l0 [x, x, x, x, x, x, x, x, x]"] + [f"&l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]"
                                                  for i in range(1, 10)]
    started = time.monotonic()
    _refused_in_one_line(lambda: apply_overrides({}, [f"train.fsdp_config={{k: [{', '.join(levels)}]}}"]),
                         "override 'train.fsdp_config': its YAML aliases expand")
    assert time.monotonic() - started < 1.0
