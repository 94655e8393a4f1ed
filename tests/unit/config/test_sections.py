"""Typed recipe sections: static pydantic classes, one default and one name list each, read by attribute."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from neutrain.config import (
    FUSED_OPTIMIZERS, KV_CACHES, OPTIMIZERS, SECTION_TYPES, SECTIONS, MemorySection, Recipe, RecipeError, load_recipe,
    section_from, validate_recipe,
)
from neutrain.config.schema import REQUIRED, SCHEMA
from tests.helpers import load_shipped_recipe, write_recipe

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "neutrain"
SHIPPED = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
SCHEMA_FILE = PACKAGE / "config" / "names.py"

# ``.get("<schema key>", default)`` calls that are not on a recipe section, or not yet converted:
# run_state reads a checkpoint's trainer_state.json; distributed/arguments.py is the distributed
# mode's code, which is being reshaped separately.
GET_ALLOWED = {("trainer/run_state.py", "max_steps")}


def _trees():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def test_section_types_cover_the_schema_in_order():
    assert tuple(SECTION_TYPES) == SECTIONS
    for name, cls in SECTION_TYPES.items():
        assert list(cls.model_fields) == list(SCHEMA[name]) and cls.section == name


def test_each_field_default_is_the_schema_default():
    for name, cls in SECTION_TYPES.items():
        for field_name, f in cls.model_fields.items():
            key = SCHEMA[name][field_name]
            if key.default is REQUIRED:
                assert f.is_required(), field_name
            elif f.default_factory is not None:
                made = f.default_factory()
                assert made == key.default and made is not key.default, f"{name}.{field_name}"  # a copy per section
            else:
                assert f.default == key.default, f"{name}.{field_name}"


def test_no_section_reads_as_a_mapping(tmp_path):
    """Consumers read attributes (``recipe.train.learning_rate``); the dict façade is gone."""
    recipe = load_recipe(write_recipe(tmp_path))
    with pytest.raises(TypeError):
        recipe.train["learning_rate"]  # type: ignore[index]
    assert not hasattr(recipe.train, "get")


@pytest.mark.slow
def test_no_module_re_declares_a_schema_default():
    """A section holds every key, so ``section.get("key", default)`` can only re-declare (or contradict) a default."""
    keys = {k for section in SCHEMA.values() for k in section}
    found = []
    for path, tree in _trees():
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and len(node.args) == 2 and isinstance(node.args[0], ast.Constant) and node.args[0].value in keys
                    and (rel, node.args[0].value) not in GET_ALLOWED):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "defaults re-declared where they are used:\n" + "\n".join(found)


@pytest.mark.slow
@pytest.mark.parametrize("names", [FUSED_OPTIMIZERS, KV_CACHES], ids=["fused-optimizers", "kv-caches"])
def test_each_name_list_is_written_once(names):
    """A tuple, list or set literal holding two or more of these names exists only in the schema."""
    found = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                held = {e.value for e in node.elts if isinstance(e, ast.Constant)} & set(names)
                if len(held) >= 2 and path != SCHEMA_FILE:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "names listed again:\n" + "\n".join(found)


def test_the_schema_names_are_the_registries():
    """The recipe's names are what the registries registered, each registered once."""
    from neutrain.eval.kv.registry import kv_cache_specs
    from neutrain.optim.registry import optimizer_specs
    from neutrain.trainer import trainer

    assert tuple(FUSED_OPTIMIZERS) == tuple(spec.name for spec in optimizer_specs())
    assert tuple(KV_CACHES) == tuple(spec.name for spec in kv_cache_specs() if spec.in_recipes)
    assert trainer.FUSED_OPTIMIZERS is FUSED_OPTIMIZERS and SCHEMA["train"]["optimizer"].choices is OPTIMIZERS
    assert set(FUSED_OPTIMIZERS) < set(OPTIMIZERS) and len(set(OPTIMIZERS)) == len(OPTIMIZERS)


@pytest.mark.parametrize("name", SHIPPED)
def test_sections_round_trip_the_recipe(name, tmp_path, monkeypatch):
    """Typed sections carry exactly the validated values: as attributes, through to_dict, YAML and pickle."""
    monkeypatch.chdir(tmp_path)  # resolve_recipe_path still finds the shipped recipes (source checkout)
    recipe = load_shipped_recipe(ROOT / "recipes" / f"{name}.yaml")
    if recipe is None:
        pytest.skip(f"{name} names a file of an optional package that is not installed")
    recipe = load_recipe(name)
    assert isinstance(recipe, Recipe)
    plain = recipe.to_dict()
    for section in SECTIONS:
        typed = getattr(recipe, section)
        assert isinstance(typed, SECTION_TYPES[section])
        assert plain[section] == typed.to_dict() == {k: getattr(typed, k) for k in SCHEMA[section]}
        assert type(plain[section]) is dict
    again = validate_recipe(yaml.safe_load(yaml.safe_dump(plain, sort_keys=False)), source=recipe.source)
    assert again.to_dict() == plain
    assert pickle.loads(pickle.dumps(recipe)).to_dict() == plain


def test_sections_are_read_only(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path))
    with pytest.raises(ValidationError):
        recipe.train.learning_rate = 1.0  # type: ignore[misc]
    with pytest.raises(AttributeError, match="TrainSection has no key learning_rat"):
        recipe.train.changed(learning_rat=1.0)
    assert recipe.train.changed(learning_rate=1.0).learning_rate == 1.0 != recipe.train.learning_rate


def test_mutable_defaults_are_not_shared():
    a, b = SECTION_TYPES["eval"](), SECTION_TYPES["eval"]()
    a.kv_caches.append("shadowkv")
    assert b.kv_caches == ["full"] == SCHEMA["eval"]["kv_caches"].default


@pytest.mark.parametrize("raw, line", [
    ({"memory": {"lora_rank": 8}}, "memory: unknown key 'lora_rank'. Did you mean 'lora_r'?"),
    ({"train": {"learning_rat": 1e-3}}, "train: unknown key 'learning_rat'. Did you mean 'learning_rate'?"),
])
def test_unknown_keys_fail_with_the_same_line(tmp_path, raw, line):
    """The recipe's one line, and the same line for a partial section handed to NeuTrainer or apply_lora."""
    (section, values), = raw.items()
    path = write_recipe(tmp_path, **raw)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert str(err.value) == line
    with pytest.raises(RecipeError) as err:
        section_from(section, values)
    assert str(err.value) == line


def test_section_from_fills_schema_defaults_and_checks_values():
    m = section_from("memory", {"lora_r": 4})
    assert isinstance(m, MemorySection) and m.lora_r == 4 and m.lora_alpha == SCHEMA["memory"]["lora_alpha"].default
    assert section_from("memory", m) is m
    with pytest.raises(RecipeError, match=r"^memory\.clip_mode: 'global' is not one of per_tensor"):
        section_from("memory", {"clip_mode": "global"})


def test_recipe_derived_defaults(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path, train={"micro_batch_size": 3}, export={"format": "hf"}))
    out = recipe.train.output_dir
    assert recipe.export_dir == recipe.default_export_dir == str(Path(out) / "export")
    assert recipe.eval_micro_batch_size == 3
    recipe = load_recipe(write_recipe(tmp_path, eval={"micro_batch_size": 5}, export={"output_dir": str(tmp_path / "x")}))
    assert recipe.export_dir == str(tmp_path / "x") and recipe.eval_micro_batch_size == 5


def test_export_api_defaults_are_the_export_keys_defaults():
    import inspect

    from neutrain.export.hf import export_hf
    from neutrain.export.neuzip import export_neuzip

    export = SCHEMA["export"]
    for fn, names in ((export_hf, ("max_shard_size", "dtype")), (export_neuzip, ("max_shard_size",))):
        for name in names:
            assert inspect.signature(fn).parameters[name].default == export[name].default, (fn.__name__, name)
