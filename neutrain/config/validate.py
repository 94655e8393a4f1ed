"""Recipe loading and strict validation.

Why strict: a typo such as ``learning_rat`` silently falls back to a default in
many frameworks (axolotl's pydantic models ignore unknown keys) and costs a GPU
day. Here every unknown key is an error that names it and suggests the closest
valid key, and every wrong type, out-of-range value or missing path names the
key and what was expected.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Iterable

import yaml

from neutrain.config.errors import RecipeError
from neutrain.config.schema import REQUIRED, SCHEMA, SECTIONS, Key, Recipe

DATASET_KEYS: dict[str, Key] = {
    "path": Key(str, REQUIRED, "File, directory, or 'python-stdlib'."),
    "type": Key(str, "text", "text | completion | messages.", choices=("text", "completion", "messages")),
    "ds_type": Key(str, None, "json | jsonl | csv | parquet | text (default: from the file extension).", choices=("json", "jsonl", "csv", "parquet", "text"), nullable=True),
    "split": Key(str, "train", "train, or validation for held-out data.", choices=("train", "validation")),
    "text_field": Key(str, "text", "Column holding the text (type: text)."),
    "prompt_field": Key(str, "prompt", "Column holding the prompt (type: completion)."),
    "completion_field": Key(str, "completion", "Column holding the completion (type: completion)."),
    "messages_field": Key(str, "messages", "Column holding the list of {role, content} messages (type: messages)."),
    "max_files": Key(int, None, "python-stdlib only: use at most this many source files.", min=1, nullable=True),
}

SPECIAL_DATA_PATHS = ("python-stdlib",)


def _suggest(name: str, options: Iterable[str]) -> str:
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f" Did you mean '{match[0]}'?" if match else ""


def _type_name(t: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a mapping"}
    if isinstance(t, tuple):
        return " or ".join(names.get(x, x.__name__) for x in t)
    return names.get(t, t.__name__)


def _check_value(where: str, key: Key, value: Any, base_dir: Path | None) -> Any:
    if value is None:
        if key.nullable or key.default is None:
            return None
        raise RecipeError(f"{where}: expected {_type_name(key.type)}, got null")
    types = key.type if isinstance(key.type, tuple) else (key.type,)
    ok = False
    for t in types:
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            value, ok = float(value), True
            break
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            ok = True
            break
        if t not in (int, float) and isinstance(value, t):
            ok = True
            break
    if not ok and float in types and isinstance(value, str):
        # YAML 1.1 reads "1e-5" (no dot) as a string; accept numeric strings for floats.
        try:
            value, ok = float(value), True
        except ValueError:
            pass
    if not ok:
        raise RecipeError(f"{where}: expected {_type_name(key.type)}, got {type(value).__name__} {value!r}")
    if key.choices is not None and value not in key.choices:
        raise RecipeError(f"{where}: {value!r} is not one of {', '.join(map(str, key.choices))}.{_suggest(str(value), map(str, key.choices))}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if key.min is not None and value < key.min:
            raise RecipeError(f"{where}: {value} is below the minimum {key.min}")
        if key.max is not None and value > key.max:
            raise RecipeError(f"{where}: {value} is above the maximum {key.max}")
    if key.path and isinstance(value, str):
        p = Path(value)
        if not p.is_absolute() and base_dir is not None and not p.exists() and (base_dir / p).exists():
            p = base_dir / p
        if not p.exists():
            raise RecipeError(f"{where}: path '{value}' does not exist")
        value = str(p)
    return value


def _validate_mapping(where: str, raw: dict, keys: dict[str, Key], base_dir: Path | None) -> dict:
    if not isinstance(raw, dict):
        raise RecipeError(f"{where}: expected a mapping, got {type(raw).__name__}")
    for name in raw:
        if name not in keys:
            raise RecipeError(f"{where}: unknown key '{name}'.{_suggest(str(name), keys)}")
    out = {}
    for name, key in keys.items():
        if name in raw:
            out[name] = _check_value(f"{where}.{name}", key, raw[name], base_dir)
        elif key.default is REQUIRED:
            raise RecipeError(f"{where}: missing required key '{name}'")
        else:
            default = key.default
            out[name] = list(default) if isinstance(default, list) else default
    return out


def _validate_datasets(entries: list, base_dir: Path | None) -> list[dict]:
    if not entries:
        raise RecipeError("data.datasets: expected at least one dataset")
    out = []
    for i, entry in enumerate(entries):
        where = f"data.datasets[{i}]"
        if isinstance(entry, str):
            entry = {"path": entry}
        ds = _validate_mapping(where, entry, DATASET_KEYS, base_dir)
        path = ds["path"]
        if path not in SPECIAL_DATA_PATHS:
            p = Path(path).expanduser()
            if not p.is_absolute() and base_dir is not None and not p.exists() and (base_dir / p).exists():
                p = base_dir / p
            if not p.exists():
                raise RecipeError(f"{where}.path: data file '{path}' does not exist")
            ds["path"] = str(p)
        out.append(ds)
    return out


def validate_recipe(raw: dict, source: str | None = None, base_dir: Path | None = None) -> Recipe:
    """Validate a raw recipe mapping and fill defaults.

    Args:
        raw: The parsed YAML (sections mapping to key/value mappings).
        source: File name, for messages.
        base_dir: Directory relative paths may also be resolved against.

    Returns:
        A :class:`Recipe`.

    Raises:
        RecipeError: naming the offending key and what was expected.
    """
    where = source or "recipe"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RecipeError(f"{where}: expected a mapping of sections ({', '.join(SECTIONS)}), got {type(raw).__name__}")
    for section in raw:
        if section not in SCHEMA:
            raise RecipeError(f"{where}: unknown section '{section}'.{_suggest(str(section), SECTIONS)} Sections are: {', '.join(SECTIONS)}")
    values = {}
    for section, keys in SCHEMA.items():
        values[section] = _validate_mapping(section, raw.get(section) or {}, keys, base_dir)
    values["data"]["datasets"] = _validate_datasets(values["data"]["datasets"], base_dir)
    _cross_checks(values)
    return Recipe(**values, source=source)


def _cross_checks(v: dict) -> None:
    model, data, train = v["model"], v["data"], v["train"]
    if model["init"] == "pretrained" and not model["base_model"]:
        raise RecipeError("model.base_model: required when model.init is 'pretrained' (or set model.init: random with model.config)")
    if model["init"] == "random" and model["config"] is None and not model["base_model"]:
        raise RecipeError("model.config: required when model.init is 'random' and no base_model gives a config")
    if isinstance(model["config"], str) and not Path(model["config"]).exists():
        raise RecipeError(f"model.config: config file '{model['config']}' does not exist")
    if model["tokenizer"] is None and not model["base_model"]:
        raise RecipeError("model.tokenizer: required when there is no base_model (use 'byte' or 'train-bpe' for no download)")
    if data["streaming"] and train["max_steps"] <= 0:
        raise RecipeError("train.max_steps: must be > 0 when data.streaming is true (a stream has no known length)")
    mem = v["memory"]
    fused = train["optimizer"] in ("lomo", "adalomo", "adamw-in-backward")
    if mem["weights"].startswith("neuzip-lossy") and mem["adapter"] is None:
        raise RecipeError(f"memory.weights: {mem['weights']} weights cannot be trained (small updates would be rounded away); use neuzip-lossless, or set memory.adapter: lora")
    if mem["adapter"] is not None and fused:
        raise RecipeError(f"train.optimizer: LoRA adapters train with adamw or sgd (the frozen base gets no update), not {train['optimizer']}")
    if mem["weights"] == "neuzip-lossless" and mem["adapter"] is None and not fused:
        raise RecipeError(f"train.optimizer: compressed weights are updated inside backward; use lomo, adalomo or adamw-in-backward, not {train['optimizer']}")
    for cache in v["eval"]["kv_caches"]:
        if cache not in ("full", "minicache", "shadowkv"):
            raise RecipeError(f"eval.kv_caches: {cache!r} is not one of full, minicache, shadowkv.{_suggest(str(cache), ('full', 'minicache', 'shadowkv'))}")


def _parse_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict, overrides: Iterable[str]) -> dict:
    """Apply dotted ``section.key=value`` overrides (values parsed as YAML).

    Example:
        >>> apply_overrides({"train": {}}, ["train.learning_rate=1e-5"])["train"]["learning_rate"]
        1e-05
    """
    raw = dict(raw or {})
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override '{item}': expected section.key=value, e.g. train.learning_rate=1e-5")
        dotted, text = item.split("=", 1)
        parts = dotted.strip().split(".")
        if len(parts) != 2 or not all(parts):
            raise RecipeError(f"override '{item}': expected section.key=value with one dot, e.g. train.learning_rate=1e-5")
        section, key = parts
        if section not in SCHEMA:
            raise RecipeError(f"override '{item}': unknown section '{section}'.{_suggest(section, SECTIONS)}")
        sec = dict(raw.get(section) or {})
        sec[key] = _parse_scalar(text)
        raw[section] = sec
    return raw


def load_recipe(path: str | os.PathLike, overrides: Iterable[str] = ()) -> Recipe:
    """Read, override and validate a recipe file.

    Args:
        path: A YAML recipe, or the name of a shipped recipe (``default`` -> ``recipes/default.yaml``).
        overrides: Dotted ``section.key=value`` strings.

    Example:
        >>> recipe = load_recipe("recipes/default.yaml", ["train.max_steps=10"])
    """
    p = resolve_recipe_path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RecipeError(f"{p}:{at} is not valid YAML ({getattr(exc, 'problem', exc)})") from None
    raw = apply_overrides(raw, overrides)
    return validate_recipe(raw, source=str(p), base_dir=p.parent)


def recipe_dirs() -> list[Path]:
    """Where shipped recipes are looked up: ``$NEUTRAIN_RECIPES``, ./recipes, and the source checkout's recipes/."""
    dirs = []
    if os.environ.get("NEUTRAIN_RECIPES"):
        dirs.append(Path(os.environ["NEUTRAIN_RECIPES"]))
    dirs.append(Path.cwd() / "recipes")
    dirs.append(Path(__file__).resolve().parents[2] / "recipes")
    seen, out = set(), []
    for d in dirs:
        if d.is_dir() and d.resolve() not in seen:
            seen.add(d.resolve())
            out.append(d)
    return out


def resolve_recipe_path(path: str | os.PathLike) -> Path:
    """A recipe path as given, or a shipped recipe's name."""
    p = Path(path)
    if p.is_file():
        return p
    if p.suffix not in (".yaml", ".yml") or not p.exists():
        for d in recipe_dirs():
            for cand in (d / f"{path}.yaml", d / str(path)):
                if cand.is_file():
                    return cand
    if p.is_dir():
        raise RecipeError(f"recipe '{path}' is a directory, expected a YAML file")
    raise RecipeError(f"recipe file '{path}' does not exist (see `neutrain recipes` for shipped recipes)")
