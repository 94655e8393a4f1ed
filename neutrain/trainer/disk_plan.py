"""What a run will write to disk, checked before its first step: the length of every path, and the space.

Why: an ``export.output_dir`` whose name was too long for the file system failed only after all the
training, with a message naming a hidden staging folder instead of the key; a full disk was found at the
final save (a 70B trained for minutes, then "disk full"), and the save left its partial files behind, so
the next run on that disk failed too. Both are known before the first step:

* **Paths.** Each output folder's longest planned path (the temporary checkpoint and the names inside it,
  the export's staging and set-aside names, the lock beside it) is measured against the file system's
  ``NAME_MAX`` for each name and ``PATH_MAX`` for the whole (:func:`check_path_lengths`).
* **Space.** Layer inputs the fit spilled to a file (:mod:`neutrain.memory.tiers`) take their bytes under
  ``train.output_dir/.cache`` while the run trains (the export comes after), plus :data:`SPILL_ROOM`. A checkpoint's size is the bytes
  its weights are saved in (the model's own tensors:
  dense, NeuZip blobs or LoRA adapters) plus the optimizer state the optimizer keeps (AdamW's two
  moments); at most ``train.save_total_limit`` of them are kept, with one more while it is written;
  the export is written beside the previous one. Only what will certainly be needed is counted (the
  RNG states, scheduler and tokenizer are left out), so the check refuses only a certain failure
  (:func:`check_disk_space`). A run that saves nothing (``train.save_steps`` past ``train.max_steps``
  with ``train.save_final: false``, and no export) needs no room.

Example:
    >>> planned_saves(start=0, max_steps=10, save_steps=4, save_final=True)
    3
    >>> planned_saves(start=0, max_steps=10, save_steps=20, save_final=False)
    0
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

from neutrain.config.schema import FUSED_OPTIMIZERS
from neutrain.errors import RecipeError
from neutrain.files import nearest_existing, path_too_long
from neutrain.optim.registry import optimizer_spec

GIB = 1 << 30
_PID_DIGITS = 7  # pid_max is at most 4194304 on Linux
_PID = "9" * _PID_DIGITS
# The longest names neutrain and the Trainer write inside a checkpoint and an export.
CHECKPOINT_FILES = (f".neutrain_manifest.json.tmp{_PID}", "model-00001-of-00001.safetensors",
                    "model.safetensors.index.json", "special_tokens_map.json", "rng_state_9999.pth")
EXPORT_FILES = (f".neutrain_manifest.json.tmp{_PID}", "model-00001-of-00001.safetensors",
                "model.safetensors.index.json", "generation_config.json")


def planned_paths(recipe, processes: int = 1) -> dict[str, list[str]]:
    """The longest paths a run writes, by the key that names their folder (absolute)."""
    t = recipe.train
    out = os.path.abspath(t.output_dir)
    step = f"checkpoint-{t.max_steps if t.max_steps > 0 else 10 ** 9 - 1}"  # by epochs: a step of nine digits
    paths = {"train.output_dir": [
        *(os.path.join(out, f".tmp-{step}", step, name) for name in CHECKPOINT_FILES),
        os.path.join(out, f".tmp-old-{step}"), os.path.join(out, f"tokenizer.tmp{_PID}", "tokenizer_config.json"),
        os.path.join(out, f"summary.json.tmp{_PID}"), os.path.join(out, ".cache", f"python-stdlib-{'0' * 12}.tmp{_PID}"),
        os.path.join(out, "eval", "long_context_shadowkv.json"), os.path.join(out, "distill", "training_curves.png"),
    ]}
    if recipe.export.format != "none":
        key = "export.output_dir" if recipe.export.output_dir else "train.output_dir"
        paths.setdefault(key, []).extend(export_paths(recipe.export_dir))
    return paths


def export_paths(output_dir: str | os.PathLike) -> list[str]:
    """The longest paths an export into ``output_dir`` writes: its staging and set-aside siblings, the lock beside
    it, and the names inside (a run's export and ``neutrain export --output`` alike)."""
    export = Path(os.path.abspath(output_dir))
    return [*(str(export.with_name(f".tmp-{export.name}-{_PID}") / name) for name in EXPORT_FILES),
            str(export.with_name(f".tmp-old-{export.name}-{_PID}")), str(export.with_name(f".neutrain-export-{export.name}.lock")),
            *(str(export / name) for name in EXPORT_FILES)]


def check_lengths(key: str, value: str, paths: list[str]) -> None:
    """Refuse, naming ``key`` (whose value is ``value``), the first of ``paths`` the file system cannot hold.

    Example:
        >>> try:
        ...     check_lengths("--output", "/tmp/" + "x" * 240, export_paths("/tmp/" + "x" * 240))
        ... except RecipeError as e:
        ...     print(str(e)[:8], "NAME_MAX" in str(e))
        --output True
    """
    shown = value if len(value) <= 60 else value[:57] + "..."
    for path in paths:
        if problem := path_too_long(path):
            raise RecipeError(f"{key}: '{shown}' is too long for its file system: neutrain writes '{path[:80]}"
                              f"{'...' if len(path) > 80 else ''}', and {problem}; choose a shorter {key}")


def check_path_lengths(recipe, processes: int = 1) -> None:
    """Refuse, naming the key, an output folder whose planned paths the file system cannot hold.

    Example:
        >>> from neutrain.config import load_recipe
        >>> try:
        ...     check_path_lengths(load_recipe("default", ["export.output_dir=/tmp/" + "x" * 250]))
        ... except RecipeError as e:
        ...     print(str(e)[:17], "NAME_MAX" in str(e))
        export.output_dir True
    """
    for key, paths in planned_paths(recipe, processes).items():
        check_lengths(key, recipe.train.output_dir if key == "train.output_dir" else recipe.export.output_dir, paths)


def planned_saves(start: int, max_steps: int, save_steps: int, save_final: bool) -> int:
    """Checkpoints a run saves from step ``start`` to ``max_steps``: every ``save_steps``, and the last step unless
    ``save_final`` is off."""
    if max_steps <= start:
        return 0
    saves = max_steps // save_steps - start // save_steps
    if save_final and max_steps % save_steps:
        saves += 1
    return saves


def _unique_bytes(tensors) -> int:
    seen, total = set(), 0
    for tensor in tensors:
        key = (tensor.data_ptr(), tensor.numel(), tensor.dtype) if tensor.numel() else None
        if key is not None and key in seen:
            continue  # tied weights are saved once
        seen.add(key)
        total += tensor.numel() * tensor.element_size()
    return total


def checkpoint_bytes(model, optimizer: str) -> int:
    """Bytes a checkpoint of ``model`` certainly takes: its saved tensors, and the optimizer's moments."""
    from neutrain.nn.lora import adapter_state_dict, is_peft_model  # lazy: only a run's planning needs them

    state = adapter_state_dict(model) if is_peft_model(model) else model.state_dict()
    weights = _unique_bytes(state.values())
    trainable = [p for p in model.parameters() if p.requires_grad]
    moments = 0
    if optimizer == "adamw":  # torch's AdamW keeps two moments in each parameter's dtype
        moments = 2 * sum(p.numel() * p.element_size() for p in trainable)
    elif optimizer in FUSED_OPTIMIZERS:  # what the optimizer's spec says its state holds
        matrices = [(p.shape[0], p.numel() // p.shape[0]) for p in trainable if p.dim() >= 2 and p.numel()]
        vectors = sum(p.numel() for p in trainable if p.dim() < 2)
        moments = int(optimizer_spec(optimizer).state.bytes(sum(p.numel() for p in trainable), matrices, vectors))
    return weights + moments


def export_bytes(model, fmt: str, dtype: str) -> int:
    """Bytes an export of ``model`` in ``fmt`` certainly takes (dense: every weight in the export's dtype; NeuZip:
    the bits its codec cannot go below)."""
    if fmt == "none":
        return 0
    params = sum(p.numel() for p in model.parameters())
    if fmt == "hf":
        width = {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype)
        if width is None:  # auto: the weights' own dtype (NeuZip decodes to it)
            width = min((p.element_size() for p in model.parameters() if p.is_floating_point()), default=2)
        return params * width
    bits = int(fmt.rsplit("-", 1)[1]) + 3 if "lossy" in fmt else 10  # sign, mantissa, the exponent's entropy
    return params * bits // 8


def free_bytes(path: str | os.PathLike) -> tuple[int, Path, int]:
    """``(free bytes, existing folder measured, its device)`` for the file system ``path`` will be written on."""
    existing = Path(nearest_existing(path))
    return shutil.disk_usage(existing).free, existing, os.stat(existing).st_dev


def size_text(n: float, up: bool = False) -> str:
    """``n`` bytes in the largest binary unit it fills, to two decimals (rounded up where ``up``): a few KiB
    printed in GiB read "0.00 GiB free" against "needs 0.01 GiB", numbers that said nothing.

    Example:
        >>> size_text(4096), size_text(3 * GIB + 1, up=True), size_text(12)
        ('4.00 KiB', '3.01 GiB', '12 bytes')
    """
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            shown = (math.ceil if up else math.floor)(n / scale * 100) / 100
            return f"{shown:.2f} {unit}"
    return f"{math.ceil(n) if up else math.floor(n)} bytes"


SPILL_ROOM = 0.05
"""Share the spilled layer inputs' file takes beyond the planner's ``layers x tokens x hidden`` bytes: each
layer also saves the rotary tables and position ids beside its input (3% for the 70B at 16K tokens), and each
tensor starts on a page."""


def check_disk_space(recipe, model, start: int, existing: int, steps: int, spill_bytes: float = 0) -> None:
    """Refuse, in one line naming the free space and the space needed, a run whose saves and export cannot fit.

    Args:
        recipe: The run's recipe.
        model: The built model (its tensors give the checkpoint's size).
        start: The step the run starts from (a resumed checkpoint's).
        existing: Checkpoints of the run already on the disk (they count towards ``save_total_limit``).
        steps: The step the run ends at (``train.max_steps``, or what the epochs come to).
        spill_bytes: Bytes of layer inputs the fit spilled to a file under ``train.output_dir``
            (:attr:`~neutrain.memory.Placement.activation_file_bytes`).
    """
    t = recipe.train
    saves = planned_saves(start, steps, t.save_steps, t.save_final)
    limit = t.save_total_limit
    held = min(existing + saves, limit + 1) if limit else existing + saves  # one more while a save is written
    slots = max(0, held - existing) if saves else 0
    size = checkpoint_bytes(model, t.optimizer)
    from neutrain.trainer.modeling import export_dtype  # lazy: modeling imports the model stack

    export = export_bytes(model, recipe.export.format, export_dtype(
        recipe.model, recipe.memory.weights, t.use_cpu, recipe.export.dtype))
    needs: dict[int, list] = {}
    free_out, where_out, dev_out = free_bytes(t.output_dir)
    spill = math.ceil(spill_bytes * (1 + SPILL_ROOM))
    needs[dev_out] = [free_out, where_out, slots * size + spill, "train.output_dir"]
    if export:
        free_exp, where_exp, dev_exp = free_bytes(recipe.export_dir)
        entry = needs.setdefault(dev_exp, [free_exp, where_exp, 0, "export.output_dir"])
        entry[2] += max(0, export - spill) if dev_exp == dev_out else export  # the file is gone before the export
    for free, where, need, key in needs.values():
        if need <= free:
            continue
        parts = []
        if slots and key == "train.output_dir":
            parts.append(f"{slots} checkpoint(s) of {size_text(size)} (train.save_total_limit "
                         f"{limit if limit else 'unset'}, plus the one being written)")
        if spill and key == "train.output_dir":
            parts.append(f"{size_text(spill, up=True)} of layer inputs spilled to a file under .cache (the host cannot "
                         "hold them)")
        if export and (key == "export.output_dir" or len(needs) == 1):
            parts.append(f"a {size_text(export)} export ({recipe.export.format})")
        raise RecipeError(
            f"{key}: {where} has {size_text(free)} free, and this run needs {size_text(need, up=True)} there "
            f"({' and '.join(parts)}): free space, lower train.save_total_limit or export.format, or save "
            f"nothing (train.save_steps past train.max_steps and train.save_final: false)")
