"""Each override names one key once: a key (or a mapping and a key inside it) overridden twice is one line naming
both overrides, for every key of every section and every command that takes overrides; a key inside a
mapping-valued key is set by more dots, the mapping's other keys kept.

Why: ``train.max_steps=3 train.max_steps=4`` trained 4 steps without a word (a script's base overrides and the
user's own: one of them lost), where a recipe refuses a key given twice and the command line a flag given twice;
``model.config.hidden_size=64`` was refused, and ``model.config={hidden_size: 64}``, the only way left, dropped
every other key of the model's config.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from neutrain.config import RecipeError, apply_overrides, load_recipe
from neutrain.config.schema import SCHEMA
from tests.helpers import TINY_LLAMA, one_error_line, write_recipe

KEYS = [f"{section}.{key}" for section, keys in SCHEMA.items() for key in keys]


@pytest.mark.parametrize("key", KEYS)
def test_every_key_overridden_twice_is_refused_naming_both(key):
    for first, second in ((f"{key}=1", f"{key}=2"), (f"{key}=1", f" {key} =2")):
        with pytest.raises(RecipeError, match=rf"^override '{second}': {key} is overridden twice \('{first}', then"):
            apply_overrides({}, [first, "eval.unrelated_key_between=1" if not key.startswith("eval.") else
                                 "train.unrelated_key_between=1", second])


MAPPINGS = [k for k in KEYS if dict in (lambda t: t if isinstance(t, tuple) else (t,))(
    SCHEMA[k.split(".")[0]][k.split(".")[1]].type)]


@pytest.mark.parametrize("key", MAPPINGS)
def test_a_mapping_and_a_key_inside_it_are_one_override(key):
    assert set(MAPPINGS) >= {"model.config", "train.lr_scheduler_kwargs", "train.fsdp_config", "distill.draft_config"}
    section, name = key.split(".")
    raw = {section: {name: {"kept": 1, "changed": 2}}}
    assert apply_overrides(raw, [f"{key}.changed=3"])[section][name] == {"kept": 1, "changed": 3}
    assert raw[section][name] == {"kept": 1, "changed": 2}, "the recipe as read is left as it was"
    for pair in ([f"{key}.changed=3", f"{key}={{a: 1}}"], [f"{key}={{a: 1}}", f"{key}.changed=3"]):
        with pytest.raises(RecipeError, match="is overridden twice"):
            apply_overrides(raw, pair)


def test_the_same_value_again_is_no_second_value():
    assert apply_overrides({}, ["train.max_steps=3", " train.max_steps =3"])["train"] == {"max_steps": 3}


@pytest.mark.parametrize("override, said", [
    ("train.max_steps.x=3", "train.max_steps is not a mapping, so it has no key 'x'"),
    ("model.config.hidden_size.x=3", "model.config.hidden_size is int 32, not a mapping, so it has no key 'x'"),
])
def test_a_key_inside_what_is_no_mapping_is_one_line(override, said):
    with pytest.raises(RecipeError, match=rf"^override '{override}': {said}"):
        apply_overrides({"model": {"config": dict(TINY_LLAMA)}}, [override])


def test_a_key_inside_the_model_config_is_set_and_its_other_keys_kept(tmp_path):
    recipe = write_recipe(tmp_path)
    overrides = ["model.config.hidden_size=64", "model.config.intermediate_size=96"]
    config = load_recipe(recipe, overrides, shape_only=True).model.config  # the shape's keys: no transformers import
    assert config == {**TINY_LLAMA, "hidden_size": 64, "intermediate_size": 96}


@pytest.mark.parametrize("command", ["train", "eval", "estimate", "distill"])
def test_every_command_refuses_a_key_overridden_twice_in_one_line(tmp_path, capsys, command):
    from neutrain.cli import main

    recipe = write_recipe(tmp_path)
    assert main([command, str(recipe), "train.max_steps=3", "--", "train.max_steps=4"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line == ("neutrain: error: override 'train.max_steps=4': train.max_steps is overridden twice "
                    "('train.max_steps=3', then 'train.max_steps=4'); give it once"), line
    assert not (tmp_path / "out").exists()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(KEYS + [f"{m}.inner" for m in MAPPINGS]), min_size=1, max_size=6))
def test_generated_override_lists_are_refused_exactly_when_a_key_repeats(keys):
    overrides = [f"{key}={i}" for i, key in enumerate(keys)]  # each a value of its own
    clash = any(a == b or a.startswith(b + ".") or b.startswith(a + ".")
                for i, a in enumerate(keys) for b in keys[:i])
    try:
        apply_overrides({}, overrides)
    except RecipeError as exc:
        assert clash and "is overridden twice" in str(exc), exc
    else:
        assert not clash
