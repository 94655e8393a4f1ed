"""Where ``neutrain generate`` puts a model: the GPU when there is one, in the form that fits its budget.

A user who fine-tuned an 8B on a 12 GB card generates on that card too. Before anything is read, the
model's config and safetensors headers are weighed against the device budget (``--device-budget-gib``,
default: ``memory.device_budget_gib: auto``'s, the card's memory less the CUDA context and a margin), and
:func:`neutrain.memory.residency.decide` picks the fastest placement that fits, as one
:class:`~neutrain.memory.residency.Residency`:

1. ``dense``: the weights as stored, on the GPU (fastest decode);
2. ``neuzip``: NeuZip lossless on the GPU, compressed one tensor at a time while reading (bit-exact);
3. ``neuzip+offload``: NeuZip lossless with as many decoder layers on the GPU as the budget holds and the
   rest streamed from pinned host memory layer by layer (``memory.offload_layers``'s store and spread).

A compressed run's ``checkpoint-N`` is placed from its blobs as they are (never encoded again): on the GPU
when the compressed weights fit, else with the layers that do not fit streamed, as in 3.

The budget is then the allocator's hard limit (``torch.cuda.set_per_process_memory_fraction``), so the
promise is kept or the command ends in one line. On a CPU, or with ``--device cpu``, the model loads as
before (``neutrain.export.load_checkpoint_model``).

Example:
    >>> from neutrain.memory import ModelShape, decide
    >>> decide(ModelShape(4096, 14336, 32, 32, 8, 128256, False, 128), int(14.5 * GIB), prompt_tokens=16,
    ...        new_tokens=64).form
    'neuzip'
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from neutrain.config.layer_placement import LayerPlacement
from neutrain.errors import CheckpointError, UserInputError
from neutrain.export import load_checkpoint_model
from neutrain.export.hf import _load_tokenizer
from neutrain.files import read_json_object
from neutrain.memory import (NEUZIP_BITS, ModelShape, Placement, Residency, decide, device_memory_used,
                             enforce_budget, resolve_budget)
from neutrain.storage.manifest import safetensors_header, verify_checkpoint
from neutrain.nn.architecture import auto_attention
from neutrain.nn.load import build
from neutrain.nn.model_spec import ModelSpec
from neutrain.nn.formats import ModelFormat, folder_format

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

GIB = 2**30
logger = logging.getLogger("neutrain")

CHAT_POSITIONS = 4096
"""Positions a chat's placement plans its KV cache for (at most the model's context): a conversation grows turn by
turn, so it cannot be measured before the model loads; the oldest turns are dropped beyond it."""


@dataclasses.dataclass(frozen=True)
class ModelFolder:
    """An export or checkpoint folder as a placement reads it, once: its format (:func:`folder_format`, which
    answers for it), the transformers config and the dtype the model is built in. The decision, its line and the
    build take it from here: each reading the folder again chose the loader anew and parsed ``config.json`` anew."""

    path: Path
    format: ModelFormat
    config: PretrainedConfig
    dtype: torch.dtype  # float32, bfloat16 or float16

    @functools.cached_property
    def weight_bytes(self) -> int:
        """The bytes of its safetensors files, from their headers alone."""
        return _weight_bytes(self.path)[0]


def read_folder(path: Path) -> ModelFolder:
    """:class:`ModelFolder` of ``path``: its loader chosen and its config read (nothing of the weights yet)."""
    import torch

    fmt = folder_format(path)  # chosen once: the decision, its line and the build ask this object
    # The dtype the weights are stored in (float32, bfloat16 or float16), else bfloat16.
    return ModelFolder(Path(path), fmt, fmt.read_config(), fmt.stored_dtype() or torch.bfloat16)


def _weight_bytes(path: Path) -> tuple[int, int]:
    """(total bytes, largest tensor's bytes) of the safetensors files in ``path``, from their headers alone."""

    total = largest = 0
    for file in sorted(path.glob("*.safetensors")):
        _, header = safetensors_header(file)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            size = info["data_offsets"][1] - info["data_offsets"][0]
            total, largest = total + size, max(largest, size)
    return total, largest


def device_budget(requested: float | None) -> int:
    """Bytes the generation may take on the current CUDA device: ``requested`` GiB (at most the card), or
    ``memory.device_budget_gib: auto``'s budget (the card less the CUDA context and a margin)."""
    import torch

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return min(resolve_budget("auto" if requested is None else requested, total), total)


def place_model(path: Path, device: str = "auto", budget_gib: float | None = None, *,
                prompt_tokens: int | Callable[[object], int] = 64, new_tokens: int = 64, extra_bytes: float = 0.0):
    """``(model, tokenizer, note, residency)``: the model of checkpoint or export ``path`` on ``device`` in the
    placement that fits a generation of ``new_tokens`` after prompts of at most ``prompt_tokens`` tokens (or
    ``prompt_tokens(tokenizer)``: counted with the folder's tokenizer, read before the model).

    ``extra_bytes``: device memory something else of the generation takes (a draft model). ``note`` is the one
    line that says where the model went on a GPU and why, ``residency`` the decision itself (both None on the CPU).
    """
    import torch

    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():

        raise UserInputError("--device cuda: no CUDA GPU is visible")
    if not use_cuda:
        model, tokenizer = load_checkpoint_model(path)
        return model, tokenizer, None, None  # as it always was: nothing to say
    budget = device_budget(budget_gib)
    enforce_budget(budget, torch.cuda.current_device())
    setting = "--device-budget-gib" + ("" if budget_gib is not None else " (auto: the card less the CUDA context and a margin)")
    return place_on(path, "cuda", budget, prompt_tokens=prompt_tokens, new_tokens=new_tokens, extra_bytes=extra_bytes,
                    setting=setting)


def place_on(path: Path, device: str, budget: int | None, *, prompt_tokens: int | Callable[[object], int] = 64,
             new_tokens: int = 64, extra_bytes: float = 0.0, setting: str = "--device-budget-gib"):
    """:func:`place_model`'s placement on ``device`` under ``budget`` bytes, the allocator's limit already set:
    ``(model, tokenizer, note, residency)``, the decision made once and the model built as it says."""
    verify_checkpoint(path)  # checksums, and no file that would run code when loaded: before any file is read
    tokenizer = _load_tokenizer(path)  # the prompts' lengths size the KV cache the placement must hold
    if callable(prompt_tokens):
        prompt_tokens = prompt_tokens(tokenizer)
    folder = read_folder(path)
    residency = resolve(path, budget, prompt_tokens=prompt_tokens, new_tokens=new_tokens, extra_bytes=extra_bytes,
                        setting=setting, folder=folder)
    note = _note(residency, folder)
    placement = residency.placement
    if not placement.compressed:
        model, _ = load_checkpoint_model(path, verified=True, folder=folder)
        return model.to(device), tokenizer, note, residency
    model = build_placed(path, placement, device, folder=folder).eval()
    return model, tokenizer, note, residency


def resolve(path: Path, budget: int | None, *, prompt_tokens: int, new_tokens: int, extra_bytes: float = 0.0,
            setting: str = "--device-budget-gib", folder: ModelFolder | None = None) -> Residency:
    """The :class:`~neutrain.memory.residency.Residency` of export or checkpoint ``path`` under ``budget`` bytes, from
    its config and safetensors headers alone (nothing is read or built). ``folder``: ``path`` as already read
    (:func:`read_folder`), else read here."""
    folder = folder or read_folder(path)
    total, config = folder.weight_bytes, folder.config
    # A compressed run's checkpoint or a NeuZip export: its files' bytes are the compressed form already.
    encoded = folder.format.encoded
    dtype_bytes = folder.dtype.itemsize
    shape = ModelShape.from_config(getattr(config, "text_config", None) or config)
    context = getattr(config, "max_position_embeddings", None)
    if isinstance(context, int) and prompt_tokens + new_tokens > context:
        new_tokens = max(context - prompt_tokens, 1)  # more is refused once loaded, in check_context's own words
    # The files' bytes against those the shape counts (the build's parameters, experts included): more only when
    # the files hold tensors the build does not make.
    modeled = shape.params() * (NEUZIP_BITS / 8 if encoded else dtype_bytes)
    return decide(shape, budget, prompt_tokens=prompt_tokens, new_tokens=new_tokens, dtype_bytes=dtype_bytes,
                  weight_scale=total / modeled, dense=not encoded, encoded=encoded,
                  extra={"draft": float(extra_bytes)} if extra_bytes else None, setting=setting)


def build_form(path: Path, form: str, device: str = "cuda", streamed: int | None = None, *,
               folder: ModelFolder | None = None):
    """The model of export or checkpoint ``path`` in a compressed ``form`` (``neuzip`` or ``neuzip+offload``) on
    ``device``, built tensor by tensor from its safetensors shards (:func:`neutrain.nn.load.build`); a compressed
    run's checkpoint is placed from its blobs, without re-encoding.

    ``neuzip+offload`` streams ``streamed`` decoder layers (None: every one), spread through the model as
    :class:`~neutrain.memory.residency.Residency` names them: each moves to host memory as soon as its last tensor
    is read, so the device never holds them; a layer split across shards waits for its other part. ``folder``:
    ``path`` as already read (:func:`read_folder`), else read here.
    """
    folder = folder or read_folder(path)
    layers = (getattr(folder.config, "text_config", None) or folder.config).num_hidden_layers
    count = 0 if form != "neuzip+offload" else layers if streamed is None else streamed
    spread = LayerPlacement.spread(layers, count).offloaded if count else ()
    return build_placed(path, Placement("neuzip-lossless", layers, spread), device, folder=folder)


def build_placed(path: Path, placement: Placement, device: str = "cuda", *, folder: ModelFolder | None = None):
    """The model of export or checkpoint ``path`` built as ``placement`` decided (compressed, with its streamed
    layers in host memory) on ``device``. ``folder``: ``path`` as already read, else read here."""
    folder = folder or read_folder(path)
    source, config, dtype = folder.format.source(), folder.config, folder.dtype
    # The attention transformers runs this architecture with (sdpa, or eager where it has none).
    spec = ModelSpec(source, config, dtype, attention=auto_attention(config, cuda=False),
                     placement=placement.build_placement(device))
    model, report = build(spec)
    logger.info("generate: %s", report)
    return model


def _config(directory: Path) -> dict:
    """The export's or checkpoint's ``config.json``, through the one reader (a FIFO there blocked the read)."""
    path = Path(directory) / "config.json"
    return read_json_object(path, f"checkpoint file '{path}'", CheckpointError, allow_nan=True)  # values: checked at build


def _note(residency: Residency, folder: ModelFolder) -> str:
    """``generate: <the decision>; weights D GiB dense, C GiB compressed`` (the files' own bytes, and the form's)."""
    total = folder.weight_bytes
    if folder.format.encoded:
        weights = f"weights {total / GIB:.2f} GiB compressed"
    else:
        weights = f"weights {total / GIB:.2f} GiB dense, {total / 16 * NEUZIP_BITS / GIB:.2f} GiB compressed"
    return f"generate: {residency.line}; {weights}"


def peak_line(residency: Residency | None = None) -> str:
    """``generate: peak GPU memory A GiB allocated, R reserved, D in use on the device at the end`` (D: all
    processes), and the peak the placement predicted."""
    import torch

    used = device_memory_used(torch.cuda.current_device())  # NVML, as the run's phase records read it
    predicted = f"; predicted {residency.predicted.reserved / GIB:.2f} reserved" if residency is not None else ""
    return (f"generate: peak GPU memory {torch.cuda.max_memory_allocated() / GIB:.2f} GiB allocated, "
            f"{torch.cuda.max_memory_reserved() / GIB:.2f} reserved, {used / GIB:.2f} in use on the device at the end"
            f"{predicted}")


def longest_prompt(tokenizer, trained_with, args, prompts: list[str] | None, directory: Path) -> int:
    """Tokens of the longest of ``prompts`` as they will be sent (through the chat template or raw); for a chat
    (None), the positions it may grow to less the new tokens."""
    from neutrain.data.chat import prompt_ids, template_choice  # lazy: `neutrain --help` stays instant

    if prompts is None:
        context = _config(directory).get("max_position_embeddings")
        positions = min(context, CHAT_POSITIONS) if isinstance(context, int) else CHAT_POSITIONS
        return max(positions - args.max_new_tokens, 1)
    if tokenizer is None:  # refused once the model is named (no tokenizer files)
        return 1
    use_template, _ = template_choice(tokenizer, trained_with, raw=args.raw)
    return max(len(prompt_ids(tokenizer, prompt, raw=not use_template)) for prompt in prompts)


def rate_line(tokens: int, seconds: float, residency=None) -> str:
    """``generate: N new tokens in S s (R tok/s, prefill included)``, and where the layers were.

    Example:
        >>> rate_line(128, 3.2)
        'generate: 128 new tokens in 3.20 s (40.0 tok/s, prefill included)'
    """
    rate = tokens / seconds if seconds > 0 else 0.0
    line = f"generate: {tokens} new tokens in {seconds:.2f} s ({rate:.1f} tok/s, prefill included)"
    if residency is not None:
        line += (f"; {residency.resident} of {residency.layers} decoder layers on the GPU, "
                 f"{len(residency.streamed)} streamed from host memory")
    return line


def draft_bytes(draft_dir: Path | None) -> float:
    """The draft model's weight bytes (its safetensors headers), which share the device with the model."""
    if draft_dir is None:
        return 0.0
    return float(_weight_bytes(draft_dir)[0])
