"""What a checkpoint was trained with, recorded beside its weights and compared with the recipe that resumes it.

Why: a dense checkpoint resumed with ``memory.weights: neuzip-lossless`` logged "resuming at
step 8" and exited 0 while its trained weights were silently dropped (their names do not
match a compressed model's, and transformers only warned of missing keys); a different
hidden size, layer count or optimizer gave a traceback; a different tokenizer or dataset
was accepted without a word.

Every checkpoint gets :data:`RUN_RECORD` (inside the checkpoint, so the manifest checksums
it like the rest): the recipe keys whose change makes a resume wrong, and the model's
shape and tokenizer as built. :func:`check_resume` compares it with the run being built
and refuses the first difference in one line, naming the key and both values.

The record also holds what the data position depends on (which rows a step takes next): the seed,
rows per step, accumulation, process count, every ``data`` key but ``num_proc``, and the size and
sha256 of each training data file. A resume that changes one is refused, saying what it means: a
changed seed, batch size or sequence length, an edited data file or a corpus cut short used to
resume with exit 0 and losses that differed from the uninterrupted run.

Dense and NeuZip-lossless weights hold the same values, and a compressed model keeps the dense one's
parameters in the same order (a placeholder stands for each compressed weight), so the optimizer state
of either fits the other: a checkpoint of one resumes into the other where both store the same dtype
(:data:`WEIGHTS_DTYPE`; ``memory.weights: auto`` may resolve differently on another card;
:func:`neutrain.nn.checkpoint_weights.load_weights` reads either format).
Any other change of the weights (lossy, an adapter) is refused: the message says how (resume with the
checkpoint's own ``memory.weights``, or start a new run from its export).
Checkpoints written before the record existed are compared on what they do hold: the
weight format (``neutrain_weights.json``) and the model shape (``config.json``).

Example:
    >>> record = run_record(recipe, model, tokenizer)                  # doctest: +SKIP
    >>> check_resume("outputs/run/checkpoint-8", record)               # doctest: +SKIP
    >>> trainer.run_record = record  # written into every checkpoint   # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from neutrain.errors import CheckpointError, UserInputError
from neutrain.files import read_json_object
from neutrain.nn.checkpoint import MARKER as WEIGHTS_MARKER  # a compressed checkpoint's weight format

RUN_RECORD = "neutrain_run.json"
LOSSLESS = ("dense", "neuzip-lossless")
"""Weight storages that hold the same values: a checkpoint of one resumes into the other (in one dtype)."""
WEIGHTS_DTYPE = "model.weights_dtype"
"""The dtype the weights are stored in (NeuZip: bf16): consulted only when the storage switches."""
RECORD_FORMAT = "neutrain-run-1"
# The model config entries that fix the shapes of the weights and of the optimizer state.
SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")


# Every recipe key of the sections that define the model a checkpoint restores, and the record entry that
# holds it (a resume that changes one is refused): the built config whole (rope_theta, norm epsilon, ...,
# not only the shapes), the dtype the weights are trained in, the vocabulary, the weights format and the
# adapter with its settings, and a LoRA run's frozen base by its content (its checkpoints hold only adapters).
MODEL_KEYS = {
    "model.config": "model.config", "model.base_model": "model.config", "model.gguf_file": "model.config",
    "model.init": "model.config", "model.dtype": "model.dtype", "model.tokenizer": "model.tokenizer",
    "model.tokenizer_vocab_size": "model.tokenizer", "memory.weights": "memory.weights",
    "memory.adapter": "memory.adapter", "memory.lora_r": "memory.lora_r", "memory.lora_alpha": "memory.lora_alpha",
    "memory.lora_dropout": "memory.lora_dropout", "memory.lora_target_modules": "memory.lora_target_modules",
}
# The other keys of those sections, and why a resume may change them.
NOT_MODEL_KEYS = {
    "model.allow_unknown_config_keys": "a validation switch: the config it lets through is compared",
    "model.attn_implementation": "the same attention, computed by another kernel",
    "model.trust_remote_code": "a permission: the config it loads is compared",
    "memory.gradient_checkpointing": "recomputes the same activations",
    "memory.offload_activations": "where activations wait, not their values",
    "memory.offload_weights": "where the weights live, not their values",
    "memory.offload_layers": "where the weights live, not their values",
    "memory.offload_slots": "how many layers' weights wait on the GPU, not their values",
    "memory.mlp_chunk_tokens": "the same MLP, computed in chunks of tokens",
    "memory.stochastic_rounding": "how the optimizer rounds its updates, not the model",
    "memory.clip_mode": "how the optimizer clips, not the model",
    "memory.device_budget_gib": "a memory limit the run plans against",
    "memory.loss_chunk_size": "the same loss, computed in chunks",
}
# Entries of a model config that say nothing about what the model computes (or are compared elsewhere).
_CONFIG_IGNORED = ("architectures", "transformers_version", "dtype", "torch_dtype", "use_cache", "pad_token_id",
                   "bos_token_id", "eos_token_id", "output_attentions", "output_hidden_states", "return_dict",
                   "attn_implementation", "quantization_config")
BASE_KEY = "model.base"
"""The record entry of a LoRA run's frozen base: :func:`neutrain.storage.fingerprint.model_fingerprint`."""


def config_record(config) -> dict[str, Any] | None:
    """The entries of a model config that define what the model computes, as JSON data (None without a config)."""
    if config is None or not hasattr(config, "to_dict"):
        return None
    data = json.loads(json.dumps(config.to_dict(), default=str))
    return {k: v for k, v in sorted(data.items()) if not k.startswith("_") and k not in _CONFIG_IGNORED}


class ResumeMismatchError(UserInputError):
    """The checkpoint to resume was trained with something the recipe now changes."""


def tokenizer_fingerprint(tokenizer) -> str:
    """``"<n> tokens, sha256 <12 hex>"`` of the vocabulary (token -> id), the same for the same tokenizer."""
    vocab = sorted(tokenizer.get_vocab().items())
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()
    return f"{len(vocab)} tokens, sha256 {digest[:12]}"


# What the data position depends on, and what a change would mean for the steps after the checkpoint.
_ORDER = "it fixes which rows are trained and in which order"
_ROWS = "it fixes how the text is cut into rows"
_TOKENS = "it fixes which tokens are trained"
DATA_POSITION = {
    "train.seed": "it fixes the order the rows are drawn in",
    "train.micro_batch_size": "it fixes how many rows each step takes",
    "train.gradient_accumulation_steps": "it fixes how many rows each step takes",
    "processes": "each process of the launch takes its share of every step's rows",
    "data.sequence_len": _ROWS, "data.sample_packing": _ROWS,
    "data.val_set_size": _ORDER, "data.max_samples": _ORDER, "data.shuffle_seed": _ORDER, "data.streaming": _ORDER,
    "data.train_on_inputs": _TOKENS, "data.chat_template": _TOKENS, "data.roles_to_train": _TOKENS,
}
DATA_FILES = "data.files"


def run_record(recipe, model, tokenizer, processes: int = 1, files: dict[str, str] | None = None,
               base: str | None = None) -> dict[str, Any]:
    """The recipe keys, launch and data a checkpoint of this run must agree with, and the built model, by key.

    ``files``: the training data files' fingerprints (:func:`neutrain.data.sources.file_fingerprints`).
    ``base``: a LoRA run's frozen base, by content (:func:`neutrain.storage.fingerprint.model_fingerprint`).
    """
    from neutrain.trainer.modeling import resolve_dtype  # lazy: modeling imports the model stack

    config = getattr(model, "config", None)
    memory = recipe.memory
    record: dict[str, Any] = {
        "memory.weights": memory.weights,
        "memory.adapter": memory.adapter,
        "train.optimizer": recipe.train.optimizer,
        "model.tokenizer": tokenizer_fingerprint(tokenizer),
        "model.dtype": str(resolve_dtype(recipe.model.dtype, recipe.train.use_cpu)).replace("torch.", ""),
        "data.datasets": recipe.data.datasets,
        "processes": processes,
    }
    if memory.adapter:
        record.update({key: getattr(memory, key.split(".")[1]) for key in
                       ("memory.lora_r", "memory.lora_alpha", "memory.lora_dropout", "memory.lora_target_modules")})
        if base is not None:
            record[BASE_KEY] = base
    for key in DATA_POSITION:
        section, _, name = key.partition(".")
        if name:
            record[key] = getattr(getattr(recipe, section), name)
    if files is not None:
        record[DATA_FILES] = files
    for key in SHAPE_KEYS:
        if config is not None and getattr(config, key, None) is not None:
            record[f"model.config.{key}"] = getattr(config, key)
    dtype = _weights_dtype(model)
    if dtype is not None:
        record[WEIGHTS_DTYPE] = dtype
    built = config_record(config)
    if built is not None:
        record["model.config"] = built
    return record


def _weights_dtype(model) -> str | None:
    """The dtype a model stores its weight matrices in (a compressed weight's, else the first matrix's)."""
    for module in model.modules():
        weight = getattr(module, "compressed", None)
        if weight is not None:
            return str(weight.dtype).removeprefix("torch.")
    for param in model.parameters():
        if param.dim() >= 2:
            return str(param.dtype).removeprefix("torch.")
    return None


def write_run_record(checkpoint_dir: str | os.PathLike, record: dict[str, Any]) -> None:
    """Write ``record`` into the checkpoint being saved (before its manifest, which then covers it)."""
    path = Path(checkpoint_dir) / RUN_RECORD
    path.write_text(json.dumps({"format": RECORD_FORMAT, "record": record}, indent=1, default=str), encoding="utf-8")


def saved_record(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """What ``checkpoint_dir`` says it was trained with: its record, else what an older checkpoint holds."""
    directory = Path(checkpoint_dir)
    path = directory / RUN_RECORD
    if os.path.lexists(path):  # a FIFO or a directory in its place is no record either
        try:
            saved = read_json_object(path, f"checkpoint file '{path}'", CheckpointError)
            record = saved.get("record") if saved.get("format") == RECORD_FORMAT else None
        except CheckpointError:
            record = None
        if not isinstance(record, dict):
            raise CheckpointError(f"checkpoint file '{path}' is not a neutrain run record (corrupt or replaced)")
        return record
    record = {}
    marker = directory / WEIGHTS_MARKER
    if marker.is_file():
        try:
            record["memory.weights"] = read_json_object(marker, f"checkpoint file '{marker}'", CheckpointError)["weights"]
        except (CheckpointError, KeyError):
            pass  # the manifest and the loader report a damaged marker
    elif (directory / "model.safetensors").is_file() or (directory / "model.safetensors.index.json").is_file():
        record["memory.weights"] = "dense"
    try:  # a broken config is the loader's to report; a FIFO is refused unopened
        config = read_json_object(directory / "config.json", f"checkpoint file '{directory / 'config.json'}'",
                                  CheckpointError)
    except CheckpointError:
        config = {}
    if config:
        record.update({f"model.config.{k}": config[k] for k in SHAPE_KEYS if config.get(k) is not None})
    return record


def _show(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str, sort_keys=True)
    return text if len(text) <= 120 else text[:117] + "..."


def _advice(key: str, old: Any) -> str:
    if key in DATA_POSITION:
        return (f"{DATA_POSITION[key]}, so the steps after the checkpoint would not continue the run it began (other "
                f"rows, losses that differ from an uninterrupted run). Resume with {key}={_show(old)}, or start a new "
                f"run in another train.output_dir")
    if key == "memory.weights":
        return (f"resume with memory.weights={old} (a checkpoint's weights and optimizer state are not converted "
                f"between formats), or export it and start a new run from the export")
    if key == "train.optimizer":
        return f"resume with train.optimizer={old}, or set train.resume_reset_optimizer=true to start its state afresh"
    if key == "model.dtype":
        return (f"resume with model.dtype={old} (the weights would be rounded to the new dtype, or trained in another "
                f"precision than they were), or export it and start a new run from the export")
    if key == BASE_KEY:
        return ("its adapters were trained on another base (by content): resume with the base the run was trained on "
                "(model.base_model), or start a new run in another train.output_dir")
    return f"resume with the checkpoint's {key}, or start a new run in another train.output_dir"


def check_resume(checkpoint_dir: str | os.PathLike, current: dict[str, Any], reset_optimizer: bool = False) -> None:
    """Refuse (one line, naming the key and both values) a resume whose recipe differs from the checkpoint's.

    Args:
        checkpoint_dir: the checkpoint to resume.
        current: :func:`run_record` of the run being built.
        reset_optimizer: ``train.resume_reset_optimizer``: the optimizer may then change.

    Raises:
        ResumeMismatchError: the first key that differs.
    """
    saved = saved_record(checkpoint_dir)
    for key, old in saved.items():
        if key not in current or (key == "train.optimizer" and reset_optimizer):
            continue
        if key == WEIGHTS_DTYPE:
            continue  # compared below, where the storage switches
        if key == "memory.weights" and {old, current[key]} <= set(LOSSLESS):
            was, now = saved.get(WEIGHTS_DTYPE), current.get(WEIGHTS_DTYPE)
            if old == current[key] or was is None or now is None or was == now:
                continue  # the same values either way (see the module docstring)
            raise ResumeMismatchError(
                f"cannot resume {checkpoint_dir}: it was trained with memory.weights={old} ({was} weights), this "
                f"recipe has memory.weights={current[key]} ({now} weights); the two resume into each other only in "
                f"one dtype: resume with memory.weights={old}, or start a new run from its export")
        new = json.loads(json.dumps(current[key], default=str))  # as the record reads back
        where = _difference(key, old, new)
        if where is not None and key == DATA_FILES:
            raise ResumeMismatchError(_changed_file(checkpoint_dir, old, new))
        if where is not None:
            path, was, now = where
            raise ResumeMismatchError(
                f"cannot resume {checkpoint_dir}: it was trained with {path}={_show(was)}, this recipe has "
                f"{path}={_show(now)}; {_advice(key, old)}")


def check_finished_resume(checkpoint_dir: str | os.PathLike, started_with: dict[str, Any] | None,
                          current: dict[str, Any] | None) -> None:
    """Refuse (one line, naming the key and both values) the resume of a finished run with a recipe that changes a
    key of :data:`MODEL_KEYS` from the recipe the run was started with (its identity file's).

    Why: a finished run's resume trains nothing and builds no model, so :func:`check_resume`, which compares the
    built model, never ran: ``train.resume_from_checkpoint=true model.dtype=bfloat16`` (or another
    ``model.config``) on a finished run said "run already finished", exit 0, as if the run were the one asked for.
    The two weight storages that hold the same values (:data:`LOSSLESS`) are one here too, as at a resume.

    Example:
        >>> check_finished_resume("out/checkpoint-4", {"model": {"dtype": "float32"}}, {"model": {"dtype": "bfloat16"}})
        Traceback (most recent call last):
        neutrain.trainer.resume_check.ResumeMismatchError: cannot resume out/checkpoint-4: it was trained with model.dtype=float32, ...
    """
    if not started_with or not current:
        return
    adapter = any((recipe.get("memory") or {}).get("adapter") for recipe in (started_with, current))
    for key in MODEL_KEYS:
        section, name = key.split(".")
        old, new = (started_with.get(section) or {}).get(name), (current.get(section) or {}).get(name)
        if key == "memory.weights" and {old, new} <= set(LOSSLESS):
            continue
        if key.startswith("memory.lora_") and not adapter:  # no adapter either way: the settings define nothing
            continue
        where = _difference(key, old, json.loads(json.dumps(new, default=str)))
        if where is not None:
            path, was, now = where
            raise ResumeMismatchError(
                f"cannot resume {checkpoint_dir}: it was trained with {path}={_show(was)}, this recipe has "
                f"{path}={_show(now)} (the run is finished: nothing would be trained); {_advice(key, old)}")


def _changed_file(checkpoint_dir, old: dict, new: dict) -> str:
    """The line for training data that differs from the checkpoint's: which file, and how."""
    name = next(f for f in [*old, *new] if old.get(f) != new.get(f))
    was, now = old.get(name, "absent"), new.get(name, "absent")
    return (f"cannot resume {checkpoint_dir}: data file '{name}' is not what it was trained on (then {was}; now {now}), "
            f"so the rows after the checkpoint would not be those the run would have trained on. Restore the file, or "
            f"start a new run in another train.output_dir")


def _difference(path: str, old: Any, new: Any) -> tuple[str, Any, Any] | None:
    """The first place where ``old`` and ``new`` differ, as ``(key path, old, new)``; None when equal.

    Example:
        >>> _difference("data.datasets", [{"path": "a", "max_files": 6}], [{"path": "a", "max_files": 5}])
        ('data.datasets[0].max_files', 6, 5)
    """
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            found = _difference(f"{path}.{key}", old.get(key), new.get(key))
            if found is not None:
                return found
        return None
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for i, (a, b) in enumerate(zip(old, new)):
            found = _difference(f"{path}[{i}]", a, b)
            if found is not None:
                return found
        return None
    return None if old == new else (path, old, new)
