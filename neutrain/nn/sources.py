"""Where a model's tensors come from: one iterator of ``(name, tensor)`` pairs per format.

Every source has the same interface, and :func:`neutrain.nn.load.build` consumes any of them
into one sink (:class:`neutrain.nn.sink.ModelSink`), dense, compressed or compressed and offloaded:

* ``keys()``: every tensor name the source will yield when it is known before reading (the
  safetensors headers: merged MoE parameters are built as their last part arrives), else None;
* ``tensors(model, device, dtype)``: the tensors, one at a time, for the skeleton ``model``
  (meta-device parameters); a dense ``torch.Tensor``, or a ``CompressedTensor`` that a neutrain
  checkpoint holds already encoded (placed as it is, or decoded for a dense model);
* ``generation_config()``: the folder's ``generation_config.json``, if it has one;
* ``label`` (files only): the file or folder in words; a source with one has its config's values and its
  floating tensors checked as they are read (finite, in range), one without (random init) does not.

The order of the tensors is the source's own: a sharded checkpoint may split a decoder layer across
files, in any key order. The sink, not the source, decides when a layer is complete.

Sources here: :class:`RandomInit`, :class:`SafetensorsFolder` (a Hugging Face folder of one or many
shards, or a hub id in the local cache), :class:`NeutrainCheckpoint` (a ``checkpoint-N`` of a
compressed run) and :class:`NeuZipExport` (``neutrain export --format neuzip``); GGUF files are
:class:`neutrain.nn.gguf.GGUFFile`. Which one a model is read from is decided once, by its format
(:func:`neutrain.nn.formats.resolve_format`).

Example:
    >>> from transformers import AutoModelForCausalLM, LlamaConfig
    >>> from accelerate import init_empty_weights
    >>> cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
    ...                   num_key_value_heads=1, vocab_size=64)
    >>> with init_empty_weights():
    ...     skeleton = AutoModelForCausalLM.from_config(cfg)
    >>> [(n, tuple(t.shape)) for n, t in RandomInit(seed=0).tensors(skeleton, "cpu", torch.bfloat16)][:2]
    [('model.embed_tokens.weight', (64, 32)), ('model.layers.0.self_attn.q_proj.weight', (32, 32))]
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Iterator, Protocol

import torch

from neutrain.compress import CompressedTensor
from neutrain.errors import CheckpointError
from neutrain.files import check_folder, read_json_object
from neutrain.nn.checkpoint import MARKER, WEIGHTS_FILE
from neutrain.nn.checkpoint_reader import read_weights
from neutrain.storage.manifest import safetensors_header


class TensorSource(Protocol):
    """The interface every source offers (see the module docstring)."""

    def keys(self) -> list[str] | None: ...

    def tensors(self, model, device, dtype: torch.dtype) -> Iterator[tuple[str, object]]: ...

    def generation_config(self): ...


@dataclasses.dataclass(frozen=True)
class RandomInit:
    """Random weights: matrices from ``N(0, config.initializer_range)`` (transformers' default for
    Llama-style models), norm weights ones and biases zeros, drawn in parameter order from a generator
    seeded with ``seed`` on the build device (the same weights for a dense and a compressed build)."""

    seed: int = 0

    def keys(self) -> list[str] | None:
        return None

    def tensors(self, model, device, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        config = model.config
        std = float(getattr(config, "initializer_range", 0.02))
        generator = torch.Generator(device=torch.device(device)).manual_seed(self.seed)
        tied_head = tied_head_name(model)
        for name, param in list(model.named_parameters()):  # the sink swaps modules meanwhile
            if name == tied_head:
                continue  # shared with the embedding after loading
            if param.dim() >= 2:
                yield name, random_normal(param.shape, std, dtype, device, generator)
            elif name.endswith("bias"):
                yield name, torch.zeros(param.shape, dtype=dtype, device=device)
            else:
                yield name, torch.ones(param.shape, dtype=dtype, device=device)

    def generation_config(self):
        return None


def tied_head_name(model) -> str | None:
    """The lm_head's weight name when the config ties it to the embedding (a source need not carry it)."""
    head = model.get_output_embeddings()
    if not getattr(model.config, "tie_word_embeddings", False) or head is None:
        return None
    return next(n for n, m in model.named_modules() if m is head) + ".weight"


_INIT_BLOCK_ELEMENTS = 1 << 22
"""Elements (in whole rows) of a host matrix drawn at once: 16 MiB of fp32 scratch, whatever the matrix's size."""


def random_normal(shape, std: float, dtype: torch.dtype, device, generator: torch.Generator) -> torch.Tensor:
    """``N(0, std)`` values of ``shape`` in ``dtype``: the bits of a whole fp32 draw rounded to ``dtype``,
    with scratch far below the fp32 matrix (a 1.96 GiB fp32 tensor for Llama-3-8B's embedding once ran a
    12 GB card out of memory while the model was built).

    On CUDA, ``normal_`` draws straight in ``dtype``: each element's Philox number depends only on its
    index and the numel, and is rounded from fp32 to ``dtype`` as ``.to(dtype)`` rounds, so no fp32 copy
    is needed. On the CPU, ``normal_`` in bf16 would draw differently, so fp32 rows are drawn in blocks
    of a multiple of 16 elements (the CPU kernel pairs values in groups of 16, and its uniforms come in
    index order), each rounded into the result: the same bits as one fp32 draw of the whole matrix.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> random_normal((4, 32), 0.02, torch.bfloat16, "cpu", g).dtype
        torch.bfloat16
    """
    device = torch.device(device)
    if device.type == "cuda" or dtype == torch.float32:
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=generator)
    out = torch.empty(shape, dtype=dtype, device=device)
    if out.numel() == 0:
        return out
    rows = out.view(-1, shape[-1])
    step = max(16, _INIT_BLOCK_ELEMENTS // max(1, shape[-1]) // 16 * 16)
    if shape[-1] < 16 or rows.shape[0] <= step:
        return out.copy_(torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, std, generator=generator))
    for start in range(0, rows.shape[0], step):
        block = rows[start:start + step]
        block.copy_(torch.empty(block.shape, dtype=torch.float32, device=device).normal_(0.0, std, generator=generator))
    return out


class SafetensorsFolder:
    """A Hugging Face checkpoint: a folder with ``config.json`` and one or many ``*.safetensors`` shards
    (with or without ``model.safetensors.index.json``), or a hub id already in the local cache.

    Tensors are read one at a time straight onto the build device, shard after shard, each shard in
    its own key order.
    """

    def __init__(self, path_or_id: str | os.PathLike):
        self.path_or_id = path_or_id
        self._directory: Path | None = None

    @property
    def label(self) -> str:
        """The model in one line's words, first in its errors (its config's values and its tensors are checked
        as they are read: :func:`neutrain.nn.load.build`)."""
        return f"model '{self.path_or_id}'"

    @property
    def directory(self) -> Path:
        if self._directory is None:
            self._directory = _resolve(self.path_or_id)
            check_folder(self._directory, self.label, CheckpointError)  # no FIFO where a reader will open a file
        return self._directory

    def read_config(self, trust_remote_code: bool = False):
        """The transformers config the folder describes."""
        from transformers import AutoConfig

        # A config class that validates its values raises huggingface_hub's own error (no ValueError) for one
        # that does not fit, e.g. a hidden size no multiple of the number of heads.
        try:
            from huggingface_hub.errors import StrictDataclassError
        except ImportError:  # a huggingface_hub that validates no config
            StrictDataclassError = ValueError
        # By name: transformers finds a local folder or the hub cache, and says which is missing (OSError).
        # The errors caught: a config.json transformers cannot make a config of.
        try:
            return AutoConfig.from_pretrained(str(self.path_or_id), trust_remote_code=trust_remote_code)
        except (ValueError, KeyError, TypeError, StrictDataclassError) as exc:
            detail = " ".join(str(exc).split())[:300]
            raise CheckpointError(f"model '{self.path_or_id}': its config.json is not a model config transformers "
                                  f"reads ({type(exc).__name__}: {detail})") from None

    def files(self) -> list[Path]:
        files = _safetensors_files(self.directory)
        for file in files:  # every tensor inside the data section and with bytes of its own, before a read
            safetensors_header(file)
        return files

    def keys(self) -> list[str] | None:
        from safetensors import safe_open

        keys: list[str] = []
        for file in self.files():
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                keys.extend(handle.keys())
        return keys

    def tensors(self, model, device, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for file in self.files():
            with safe_open(str(file), framework="pt", device=str(torch.device(device))) as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)

    def stored_dtype(self) -> torch.dtype | None:
        """The dtype of the first floating tensor in the shards (from their headers), or None."""
        from safetensors import safe_open

        for file in self.files():
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    dtype = handle.get_slice(name).get_dtype()
                    if dtype in _SAFETENSORS_FLOATS:
                        return _SAFETENSORS_FLOATS[dtype]
        return None

    def generation_config(self):
        if not (self.directory / "generation_config.json").exists():
            return None
        from transformers import GenerationConfig

        return GenerationConfig.from_pretrained(self.directory)


_SAFETENSORS_FLOATS = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


class NeutrainCheckpoint(SafetensorsFolder):
    """A ``checkpoint-N`` of a compressed run (:func:`neutrain.nn.checkpoint.save_compressed_checkpoint`):
    each compressed weight is the codec's blobs under ``<parameter>.<blob>``, yielded as one
    ``CompressedTensor`` with its checksum verified (placed without re-encoding: a resumed or exported
    model holds the exact trained bytes); norms and biases are dense. A tied lm_head is saved once
    (an alias of the embedding) and tied again by the sink.
    """

    @property
    def weights(self) -> str:
        """The weights mode the run trained with (its ``neutrain_weights.json``)."""
        path = self.directory / MARKER
        weights = read_json_object(path, f"checkpoint file '{path}'", CheckpointError).get("weights")
        if not isinstance(weights, str):
            raise CheckpointError(f"checkpoint file '{path}' names no weights mode (a \"weights\" string)")
        return weights

    def files(self) -> list[Path]:
        path = self.directory / WEIGHTS_FILE
        if not path.exists():
            raise CheckpointError(f"checkpoint '{self.directory}' has no {WEIGHTS_FILE}")
        return [path]

    def keys(self) -> list[str] | None:
        return None  # the model's own parameter names

    def tensors(self, model, device, dtype: torch.dtype) -> Iterator[tuple[str, object]]:
        tied = tied_head_name(model)
        (path,) = self.files()
        for name, value in read_weights(path):
            if name == tied:
                continue  # the embedding's own weight: the sink ties it again
            yield name, value if not isinstance(value, dict) else _assemble(value, name, device, f"checkpoint file '{path}'")


def _assemble(blobs: dict[str, torch.Tensor], owner: str, device, where: str) -> CompressedTensor:
    """One weight's codec blobs as a ``CompressedTensor`` (checksum verified), or one line naming it and ``where``."""
    try:
        return CompressedTensor.from_state_dict(blobs, name=owner, device=device)
    except (ValueError, RuntimeError, KeyError) as exc:
        raise CheckpointError(f"{where}: {owner}: {exc}") from None


NEUZIP_QUANT_METHOD = "neuzip"
"""``quantization_config.quant_method`` of a NeuZip export (``neutrain export --format neuzip``)."""


class NeuZipExport(SafetensorsFolder):
    """A NeuZip export (``neutrain export --format neuzip``, lossless or lossy): each compressed weight is the
    codec's blobs under ``<parameter>.<blob>``, in one or many shards (one weight's blobs may straddle two),
    yielded as one ``CompressedTensor``, checksum verified, placed without re-encoding; the rest is dense.

    Why a source of its own: read as a plain Hugging Face folder, its blobs reached the sink under the weight's
    name, and ``neutrain generate`` on a GPU failed on every NeuZip export ("model.embed_tokens.weight has
    shape (1,)"). Transformers loads it through neutrain's quantizer; this reads it for any placement.
    """

    def keys(self) -> list[str] | None:
        return None  # the model's own parameter names

    def tensors(self, model, device, dtype: torch.dtype) -> Iterator[tuple[str, object]]:
        from contextlib import ExitStack

        from safetensors import safe_open

        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        with ExitStack() as stack:
            handles = [(f, stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))) for f in self.files()]
            owners: dict[str, list[tuple[str, object]]] = {}  # in file order: a layer completes shard by shard
            for _, handle in handles:
                for key in handle.keys():
                    owner = key if key in params else key.rpartition(".")[0]
                    owners.setdefault(owner, []).append((key, handle))
            for owner, parts in owners.items():
                if [key for key, _ in parts] == [owner]:
                    yield owner, parts[0][1].get_tensor(owner)
                    continue
                if owner not in params:  # the sink refuses it, or skips what the model computes itself
                    for key, handle in parts:
                        yield key, handle.get_tensor(key)
                    continue
                blobs = {key[len(owner) + 1:]: handle.get_tensor(key) for key, handle in parts}
                yield owner, _assemble(blobs, owner, device, f"NeuZip export '{self.directory}'")


def _resolve(path_or_id) -> Path:
    path = Path(path_or_id)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(path_or_id), allow_patterns=["*.json", "*.safetensors"]))


def _safetensors_files(directory: Path) -> list[Path]:
    if (directory / "model.safetensors.index.json").exists():
        from neutrain.storage.confine import indexed_files

        return indexed_files(directory)  # each shard a file inside the directory, whatever the index names
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    return files
