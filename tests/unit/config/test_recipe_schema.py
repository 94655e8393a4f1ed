"""The recipe's JSON Schema (``neutrain recipes --schema``): every key in it, and every shipped recipe keeping it.

An editor checks a recipe against the schema as it is written; the schema comes from the same section classes
that validate a recipe at load, so the two cannot disagree about a key, and these tests hold both to the
shipped recipes.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from pathlib import Path

import pytest
import yaml

from neutrain.cli import main
from neutrain.config import SCHEMA, SECTION_TYPES, recipe_json_schema
from neutrain.config.names import Names
from tests.helpers import load_shipped_recipe

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = sorted((ROOT / "recipes").glob("*.yaml"))
_TYPES = {"string": str, "boolean": bool, "object": dict, "array": list, "null": type(None)}


def _schema_from_the_command() -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["recipes", "--schema"]) == 0
    return json.loads(out.getvalue())


def _problems(value, node: dict, root: dict, at: str) -> list[str]:
    """Where ``value`` breaks ``node``: the JSON Schema keywords the recipe schema uses, checked by hand (no
    jsonschema package in the test environment)."""
    if "$ref" in node:
        return _problems(value, root["$defs"][node["$ref"].rsplit("/", 1)[-1]], root, at)
    if "anyOf" in node:
        return [] if any(not _problems(value, option, root, at) for option in node["anyOf"]) else [f"{at}: no option"]
    if "const" in node and value != node["const"] or "enum" in node and value not in node["enum"]:
        return [f"{at}: {value!r} not allowed"]
    kind = node.get("type")
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "integer" and not (number and float(value).is_integer() and isinstance(value, int)) or \
            kind == "number" and not number or kind in _TYPES and not isinstance(value, _TYPES[kind]):
        return [f"{at}: {value!r} is not {kind}"]
    if number and kind in ("integer", "number"):
        bounds = (("minimum", value >= node.get("minimum", -math.inf)), ("maximum", value <= node.get("maximum", math.inf)),
                  ("exclusiveMinimum", value > node.get("exclusiveMinimum", -math.inf)),
                  ("exclusiveMaximum", value < node.get("exclusiveMaximum", math.inf)))
        return [f"{at}: {value} breaks {name}" for name, ok in bounds if not ok]
    if kind == "string" and "pattern" in node and not re.search(node["pattern"], value):
        return [f"{at}: {value!r} does not match"]
    if kind == "array" and "items" in node:
        return [p for i, v in enumerate(value) for p in _problems(v, node["items"], root, f"{at}[{i}]")]
    if kind == "object":
        properties = node.get("properties", {})
        found = [f"{at}: missing {k}" for k in node.get("required", []) if k not in value]
        found += [f"{at}: unknown {k}" for k in value if k not in properties and node.get("additionalProperties") is False]
        return found + [p for k, v in value.items() if k in properties for p in _problems(v, properties[k], root, f"{at}.{k}")]
    return []


def test_the_schema_lists_every_key_with_its_description():
    schema = _schema_from_the_command()
    assert schema == json.loads(json.dumps(recipe_json_schema()))
    assert set(schema["properties"]) == set(SECTION_TYPES) and schema["additionalProperties"] is False
    for section, keys in SCHEMA.items():
        node = schema["$defs"][SECTION_TYPES[section].__name__]
        assert list(node["properties"]) == list(keys) and node["additionalProperties"] is False, section
        for name, key in keys.items():
            field = node["properties"][name]
            assert " ".join(field["description"].split()) == key.help and key.help, f"{section}.{name}"
            if isinstance(key.choices, Names):
                assert field["enum"] == list(key.choices), f"{section}.{name}"
    assert not re.search(r'"(gt|ge|lt|le)":', json.dumps(schema)), "a bound under its Python name, not JSON Schema's"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_recipe_keeps_the_schema_and_loads(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    raw = yaml.safe_load(path.read_text())
    schema = recipe_json_schema()
    assert _problems(raw, schema, schema, path.stem) == []
    recipe = load_shipped_recipe(path)
    if recipe is not None:
        assert set(recipe.to_dict()) == set(SCHEMA)


@pytest.mark.parametrize("value, problem", [
    ({"train": {"learning_rate": 0}}, "breaks exclusiveMinimum"),
    ({"train": {"optimizer": "adam"}}, "not allowed"),
    ({"memory": {"device_budget_gib": -1}}, "no option"),
    ({"train": {"learning_rat": 1e-3}}, "unknown learning_rat"),
    ({"model": {"init": "random"}}, "missing data"),
])
def test_the_schema_refuses_what_loading_refuses(value, problem):
    """The hand checker above can fail: each of these breaks the schema, as it breaks a load."""
    schema = recipe_json_schema()
    raw = {"data": {"datasets": ["python-stdlib"]}, **value} if "init" not in str(value) else value
    assert any(problem in p for p in _problems(raw, schema, schema, "recipe")), _problems(raw, schema, schema, "recipe")
