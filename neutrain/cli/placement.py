"""Where ``neutrain generate`` puts a model: the GPU when there is one, in the form that fits its budget.

A user who fine-tuned an 8B on a 12 GB card generates on that card too. Before anything is read, the
model's bytes (from its safetensors files) are weighed against the device budget (``--device-budget-gib``,
default: ``memory.device_budget_gib: auto``'s, the card's memory less the CUDA context and a margin), and the first form that fits is taken:

1. ``dense``: the weights as stored, on the GPU (fastest decode);
2. ``neuzip``: NeuZip lossless on the GPU, compressed one tensor at a time while reading (bit-exact);
3. ``neuzip+offload``: the decoder layers' compressed weights in pinned host memory, streamed in layer
   by layer (``memory.offload_weights``'s store), for cards that hold not even the compressed model.

A compressed run's ``checkpoint-N`` is placed from its blobs as they are (never encoded again): on the GPU
when the compressed weights fit, else streamed from host memory as in 3.

The budget is then the allocator's hard limit (``torch.cuda.set_per_process_memory_fraction``), so the
promise is kept or the command ends in one line. On a CPU, or with ``--device cpu``, the model loads as
before (``neutrain.export.load_checkpoint_model``).

Example:
    >>> from neutrain.cli.placement import choose_form
    >>> choose_form(dense=16.0 * 2**30, compressed=10.9 * 2**30, scratch=1.0 * 2**30, budget=14.5 * 2**30)
    'neuzip'
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from neutrain.errors import UserInputError
from neutrain.export import load_checkpoint_model
from neutrain.export.hf import MARKER, _load_tokenizer
from neutrain.cli.memory import enforce_budget
from neutrain.storage.manifest import safetensors_header, verify_checkpoint
from neutrain.trainer.fit import resolve_budget
from neutrain.trainer.phases import device_memory_used
from neutrain.nn.architecture import auto_attention
from neutrain.nn.load import build
from neutrain.nn.model_spec import ModelSpec, Placement
from neutrain.nn.sources import NeutrainCheckpoint, SafetensorsFolder
from neutrain.trainer.planner import NEUZIP_BITS

GIB = 2**30
MARGIN_BYTES = 0.5 * GIB  # decode scratch of small tensors, the static KV cache of a short generation, logits
logger = logging.getLogger("neutrain")


def choose_form(dense: float, compressed: float, scratch: float, budget: float) -> str:
    """The first of ``dense``, ``neuzip``, ``neuzip+offload`` whose bytes fit ``budget``.

    ``scratch``: the decode buffers of the compressed forms (the largest matrix, dense).
    """
    if dense + MARGIN_BYTES <= budget:
        return "dense"
    if compressed + scratch + MARGIN_BYTES <= budget:
        return "neuzip"
    return "neuzip+offload"


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


def place_model(path: Path, device: str = "auto", budget_gib: float | None = None):
    """``(model, tokenizer, note)``: the model of checkpoint or export ``path`` on ``device`` in the form that fits.

    ``note`` is the one line that says where the model went on a GPU and why (None on the CPU).
    """
    import torch

    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():

        raise UserInputError("--device cuda: no CUDA GPU is visible")
    if not use_cuda:
        model, tokenizer = load_checkpoint_model(path)
        return model, tokenizer, None  # as it always was: nothing to say
    budget = device_budget(budget_gib)
    enforce_budget(budget, torch.cuda.current_device())
    dense, largest = _weight_bytes(path)
    if (path / MARKER).exists():  # a compressed run's checkpoint: its blobs are the compressed form already
        # Placed as they are (no re-encoding): on the GPU when they fit, else streamed from host memory.
        form = "neuzip" if dense + 2 * largest + MARGIN_BYTES <= budget else "neuzip+offload"
        verify_checkpoint(path)
        return build_form(path, form, "cuda").eval(), _load_tokenizer(path), _note(form, dense, dense, budget)
    compressed = dense / 16 * NEUZIP_BITS
    form = choose_form(dense, compressed, 2 * largest, budget)
    if form == "dense":
        model, tokenizer = load_checkpoint_model(path)
        return model.to("cuda"), tokenizer, _note(form, dense, compressed, budget)

    verify_checkpoint(path)  # checksums, and no file that would run code when loaded
    tokenizer = _load_tokenizer(path)
    return build_form(path, form, "cuda").eval(), tokenizer, _note(form, dense, compressed, budget)


def build_form(path: Path, form: str, device: str = "cuda"):
    """The model of export or checkpoint ``path`` in a compressed ``form`` (``neuzip`` or ``neuzip+offload``) on
    ``device``, built tensor by tensor from its safetensors shards (:func:`neutrain.nn.load.build`); a compressed
    run's checkpoint is placed from its blobs, without re-encoding.

    ``neuzip+offload`` moves each decoder layer to host memory as soon as its last tensor is read, so
    the device never holds the compressed model; a layer split across shards waits for its other part.
    """
    import torch

    source = NeutrainCheckpoint(path) if (path / MARKER).exists() else SafetensorsFolder(path)
    config = source.read_config()
    dtype = getattr(torch, _dtype_name(json.loads((path / "config.json").read_text())))
    placement = Placement("neuzip-lossless", offload=form == "neuzip+offload", device=device)
    # The attention transformers runs this architecture with (sdpa, or eager where it has none).
    spec = ModelSpec(source, config, dtype, attention=auto_attention(config, cuda=False), placement=placement)
    model, report = build(spec)
    logger.info("generate: %s", report)
    return model


def _dtype_name(config: dict) -> str:
    name = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    return name if name in ("float32", "bfloat16", "float16") else "bfloat16"


def _note(form: str, dense: float, compressed: float, budget: float) -> str:
    what = {"dense": "dense weights on the GPU", "neuzip": "NeuZip lossless weights on the GPU (bit-exact)",
            "neuzip+offload": "NeuZip lossless weights streamed from host memory (bit-exact)"}[form]
    return (f"generate: {what}: weights {dense / GIB:.2f} GiB dense, {compressed / GIB:.2f} GiB compressed, "
            f"device budget {budget / GIB:.2f} GiB")


def peak_line() -> str:
    """``generate: peak GPU memory A GiB allocated, R reserved, D in use on the device at the end`` (D: all processes)."""
    import torch

    used = device_memory_used(torch.cuda.current_device())  # NVML, as the run's phase records read it
    return (f"generate: peak GPU memory {torch.cuda.max_memory_allocated() / GIB:.2f} GiB allocated, "
            f"{torch.cuda.max_memory_reserved() / GIB:.2f} reserved, {used / GIB:.2f} in use on the device at the end")
