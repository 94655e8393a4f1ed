"""Every number a run reads is held to its range through the command line's own entry: each numeric recipe key,
each ``model.config`` value the build uses, each numeric ``NEUTRAIN_*`` variable.

Out of range (below, at an excluded bound, above, NaN, inf, a 400-digit integer) or of the wrong type, a value
gives exactly one ``neutrain: error:`` line that starts with its key and exit 2, never a traceback; in range,
it loads. The values come from each key's own declaration (hypothesis), so a key added later is covered.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math

import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from neutrain.cli import main
from neutrain.config import load_recipe
from neutrain.config.knobs import KNOBS
from neutrain.config.schema import SCHEMA
from tests.helpers import TINY_RECIPE

HUGE = 10**400  # no float holds it
NUMERIC = sorted((section, name) for section, keys in SCHEMA.items() for name, key in keys.items()
                 if {int, float} & set(key.type if isinstance(key.type, tuple) else (key.type,)))
# A key whose in-range values another key can still refuse: its own check, named by the key itself.
REFUSED_BY_ANOTHER_KEY = {("train", "max_steps"): 0, ("memory", "offload_layers"): None}

# The model.config values a build uses, by their rule (neutrain.config.model_values.RULES): (low, high, low open,
# high open, whole number).
CONFIG_RULES = {
    "rms_norm_eps": (1.2e-38, 1.0, False, True, False), "rope_theta": (0.0, 1e12, True, False, False),
    "attention_dropout": (0.0, 1.0, False, True, False), "initializer_range": (0.0, 1.0, False, False, False),
    "intermediate_size": (1, 4096, False, False, True), "max_position_embeddings": (1, 1 << 20, False, False, True),
    "hidden_size": (1, 2**31 - 1, False, False, True),
}
NUMERIC_KNOBS = sorted(name for name, knob in KNOBS.items() if knob.type in (int, float))


def _types(key) -> tuple:
    return key.type if isinstance(key.type, tuple) else (key.type,)


def _out_of_range(key) -> st.SearchStrategy:
    """Values the key's declaration refuses: each side of its range, non-finite, huge, and other types."""
    whole = float not in _types(key)
    bad = [st.just(math.nan), st.just(math.inf), st.just(-math.inf), st.just(HUGE), st.just(-HUGE),
           st.sampled_from(["many", [1], {"a": 1}])]
    if not key.nullable and key.default is not None:
        bad.append(st.just(None))
    if whole:
        bad += [st.just(True), st.floats(allow_nan=False, allow_infinity=False).filter(lambda v: not v.is_integer())]
    low, low_open = (key.gt, True) if key.gt is not None else (key.min, False)
    high, high_open = (key.lt, True) if key.lt is not None else (key.max, False)
    if low is not None:
        bad.append(st.integers(max_value=math.ceil(low) - (0 if low_open else 1)) if whole else
                   st.floats(max_value=low, exclude_max=not low_open, allow_nan=False))
    if high is not None:
        bad.append(st.integers(min_value=math.floor(high) + (0 if high_open else 1)) if whole else
                   st.floats(min_value=high, exclude_min=not high_open, allow_nan=False))
    return st.one_of(bad)


def _in_range(key) -> st.SearchStrategy:
    low, low_open = (key.gt, True) if key.gt is not None else (key.min, False)
    high, high_open = (key.lt, True) if key.lt is not None else (key.max, False)
    if float not in _types(key):
        return st.integers(min_value=low if low is not None else -2**31, max_value=high)
    return st.floats(min_value=low, max_value=high, exclude_min=low_open, exclude_max=high_open,
                     allow_nan=False, allow_infinity=False)


def _recipe(tmp_path, section: str, name: str, value, config: dict | None = None):
    raw = copy.deepcopy(TINY_RECIPE)
    raw["train"]["output_dir"] = str(tmp_path / "out")
    raw["model"]["config"].update(config or {})
    if name:
        raw.setdefault(section, {})[name] = value
    # A row fits the model's positions (a relation of two keys, tests/faults/test_model_config_classes.py): the key
    # not drawn follows the one drawn.
    positions, row = raw["model"]["config"]["max_position_embeddings"], raw["data"]["sequence_len"]
    if (section, name) == ("data", "sequence_len"):  # an in-range row length: the positions to hold it
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= 1 << 20:
            raw["model"]["config"]["max_position_embeddings"] = max(positions, value)
    elif isinstance(positions, int) and positions >= 8:
        raw["data"]["sequence_len"] = min(row, positions)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _cli(argv: list[str]) -> tuple[int, str]:
    """``neutrain <argv>`` in this process: its exit status and what it wrote to stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = main(argv)
        except SystemExit as exc:  # argparse, or anything else that exits on its own
            status = exc.code
    return status, err.getvalue()


def _one_line_naming(status: int, err: str, key: str) -> None:
    lines = [line for line in err.splitlines() if line.startswith("neutrain: error:")]
    assert status == 2 and "Traceback" not in err and len(lines) == 1, (status, err)
    assert lines[0].startswith(f"neutrain: error: {key}"), (key, lines[0])


SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))


@SETTINGS
@given(data=st.data(), key=st.sampled_from(NUMERIC))
def test_an_out_of_range_recipe_number_is_one_line_naming_its_key(tmp_path_factory, data, key):
    section, name = key
    value = data.draw(_out_of_range(SCHEMA[section][name]), label="value")
    path = _recipe(tmp_path_factory.mktemp("r"), section, name, value)
    _one_line_naming(*_cli(["estimate", str(path)]), f"{section}.{name}")


@SETTINGS
@given(data=st.data(), key=st.sampled_from(NUMERIC))
def test_an_in_range_recipe_number_loads(tmp_path_factory, data, key):
    section, name = key
    assume(key not in REFUSED_BY_ANOTHER_KEY or REFUSED_BY_ANOTHER_KEY[key] is not None)
    value = data.draw(_in_range(SCHEMA[section][name]), label="value")
    assume(REFUSED_BY_ANOTHER_KEY.get(key, object()) != value)
    recipe = load_recipe(_recipe(tmp_path_factory.mktemp("r"), section, name, value), shape_only=True)
    assert getattr(getattr(recipe, section), name) == value


def _config_value(rule: tuple, inside: bool) -> st.SearchStrategy:
    low, high, low_open, high_open, whole = rule
    if inside:
        return st.integers(low, high) if whole else st.floats(low, high, exclude_min=low_open, exclude_max=high_open)
    bad = [st.just(math.nan), st.just(math.inf), st.just(-math.inf), st.just(True), st.just("x"),
           st.integers(max_value=int(low) - (0 if low_open else 1))]
    bad.append(st.integers(min_value=2**31) if whole else
               st.floats(min_value=high, exclude_min=not high_open, allow_nan=False) if high_open else st.nothing())
    if whole:
        bad.append(st.floats(allow_nan=False, allow_infinity=False).filter(lambda v: not v.is_integer()))
    elif low > 0:  # between 0 and a positive floor (an epsilon that is 0 in float32)
        bad.append(st.floats(0.0, low, exclude_max=not low_open))
    return st.one_of(bad)


@SETTINGS
@given(data=st.data(), name=st.sampled_from(sorted(CONFIG_RULES)))
def test_an_out_of_range_model_config_value_is_one_line_naming_it(tmp_path_factory, data, name):
    value = data.draw(_config_value(CONFIG_RULES[name], inside=False), label="value")
    path = _recipe(tmp_path_factory.mktemp("r"), "", "", None, {name: value})
    _one_line_naming(*_cli(["estimate", str(path)]), f"model.config.{name}")


@SETTINGS
@given(hidden=st.integers(1, 512), heads=st.integers(1, 16))
def test_heads_that_do_not_divide_the_hidden_size_name_it(tmp_path_factory, hidden, heads):
    path = _recipe(tmp_path_factory.mktemp("r"), "", "", None,
                   {"hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": heads})
    if hidden % heads:
        _one_line_naming(*_cli(["estimate", str(path)]), "model.config.hidden_size")
    else:
        assume(hidden // heads % 2 == 0)  # rotary embeddings turn a head's dimensions in pairs
        load_recipe(path)


@SETTINGS
@given(data=st.data(), name=st.sampled_from(sorted(set(CONFIG_RULES) - {"hidden_size"})))
def test_an_in_range_model_config_value_loads(tmp_path_factory, data, name):
    value = data.draw(_config_value(CONFIG_RULES[name], inside=True), label="value")
    assume(name != "max_position_embeddings" or value >= 8)  # fewer positions than data.sequence_len's least row
    assert load_recipe(_recipe(tmp_path_factory.mktemp("r"), "", "", None, {name: value})).model.config[name] == value


@SETTINGS
@given(data=st.data(), name=st.sampled_from(NUMERIC_KNOBS))
def test_an_out_of_range_environment_number_is_one_line_naming_it(monkeypatch, data, name):
    knob = KNOBS[name]
    low = knob.gt if knob.gt is not None else knob.min
    text = data.draw(st.one_of(st.sampled_from(["nan", "inf", "-inf", "1e400", "many", str(HUGE)]),
                               st.floats(max_value=low, exclude_max=knob.gt is None, allow_nan=False).map(repr),
                               st.floats(min_value=knob.max, exclude_min=True, allow_nan=False).map(repr)),
                     label="text")
    monkeypatch.setenv(name, text)
    try:
        _one_line_naming(*_cli(["recipes"]), f"environment variable {name}=")
    finally:
        monkeypatch.delenv(name)
