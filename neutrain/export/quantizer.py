"""The ``neuzip`` quantization method for transformers: ``from_pretrained`` of a NeuZip export.

``import neutrain`` registers :class:`NeuZipConfig` and :class:`NeuZipHfQuantizer`
with transformers (lazily, see :mod:`neutrain.export.registration`). Then

    model = AutoModelForCausalLM.from_pretrained("<neuzip export>")

builds the model with its matrices still compressed: on the GPU when one is
present (else the CPU), each :class:`~neutrain.nn.CompressedLinear` decodes its
weight into a shared buffer in forward, layer by layer.

How loading works (the same on transformers 5.17 and 5.24; only the
two lifecycle hooks are used, not the version-specific weight-conversion API):

1. Before weights load (model on the meta device), every compressed module
   named in ``quantization_config.modules`` is swapped for a
   :class:`PendingNeuZipModule` that owns only its bias (if any). Its blobs and
   the one-byte marker (:mod:`neutrain.export.neuzip`) are added to the
   model's ``_keys_to_ignore_on_load_unexpected``, so transformers loads the
   dense tensors (norms, biases) and leaves the blobs alone.
2. After loading, the blobs are read from the checkpoint files, their checksums
   verified, and each pending module becomes a frozen compressed module on the
   model's device. Identical tensors (a tied embedding/lm_head pair) are shared.
   The output head decodes in row blocks at inference
   (:mod:`neutrain.export.inference`).

Without the registration, transformers logs "Unknown quantization type, got
neuzip ... we will skip the quantization" and tries a dense load: the marker
tensors then have the wrong shape for every compressed layer, so it raises its
size-mismatch error instead of building a model of random weights. Only
``ignore_mismatched_sizes=True`` can force that dense load, and transformers
then reports every compressed weight as newly initialised.

The loaded model is frozen (``requires_grad=False`` on the compressed weights):
``is_trainable`` is True for PEFT adapters on top; full fine-tuning goes
through ``neutrain train`` instead (``is_qat_trainable`` is False, so
``Trainer`` refuses it without adapters).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from transformers.quantizers.auto import register_quantization_config, register_quantizer
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from neutrain.compress import CompressedTensor
from neutrain.export.inference import chunk_output_head
from neutrain.nn import CompressedEmbedding, CompressedLinear, CompressedWeight
from neutrain.nn.convert import build_module, mark_large_weights
from neutrain.nn.sources import NEUZIP_QUANT_METHOD
from neutrain.storage.confine import indexed_files

QUANT_METHOD = NEUZIP_QUANT_METHOD
"""``quantization_config.quant_method`` of a NeuZip export."""

_BLOB_SUFFIX = r"(\.(header|code_lengths|lane_words|tile_base|stream|tails|checksum|name))?"


class NeuZipConfig(QuantizationConfigMixin):
    """``quantization_config`` of a NeuZip export.

    Args:
        mantissa_bits: None (lossless) or the kept mantissa bits of a lossy export.
        modules: Names of the compressed modules (``nn.Linear``/``nn.Embedding`` in the dense model).

    Example:
        >>> NeuZipConfig(mantissa_bits=3, modules=["lm_head"]).to_dict()["quant_method"]
        'neuzip'
    """

    def __init__(self, mantissa_bits: int | None = None, modules: list[str] | None = None, **kwargs):
        self.quant_method = QUANT_METHOD
        self.mantissa_bits = mantissa_bits
        self.modules = list(modules or [])
        self.format_version = int(kwargs.pop("format_version", 1))

    def to_dict(self) -> dict[str, Any]:
        return {"quant_method": QUANT_METHOD, "mantissa_bits": self.mantissa_bits, "modules": list(self.modules),
                "format_version": self.format_version}


class PendingNeuZipModule(torch.nn.Module):
    """Stands in for a compressed layer while transformers loads the dense tensors (holds the bias only)."""

    def __init__(self, dense: torch.nn.Module):
        super().__init__()
        self.kind = "embedding" if isinstance(dense, torch.nn.Embedding) else "linear"
        self.padding_idx = getattr(dense, "padding_idx", None)
        self.bias = getattr(dense, "bias", None)
        # Kept unregistered: a scaled embedding (Gemma) is rebuilt with its scale from it.
        self.__dict__["original"] = dense

    def forward(self, *args, **kwargs):  # pragma: no cover - replaced before any forward
        raise RuntimeError("NeuZip weights were not loaded (the quantizer's post-loading step did not run)")


def _checkpoint_index(files: list[str]) -> dict[str, str]:
    """Tensor name -> file holding it (from the safetensors headers only)."""
    from safetensors import safe_open

    where: dict[str, str] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            where.update(dict.fromkeys(handle.keys(), str(file)))
    return where


def _checkpoint_files(model, given) -> list[str]:
    if given:
        return [str(f) for f in given]
    directory = Path(getattr(model.config, "_name_or_path", "") or getattr(model.config, "name_or_path", ""))
    if (directory / "model.safetensors.index.json").exists():
        return [str(f) for f in indexed_files(directory)]  # each shard confined to the directory
    return [str(f) for f in sorted(directory.glob("*.safetensors"))]


def load_neuzip_modules(model: torch.nn.Module, files: list[str], device: torch.device) -> int:
    """Replace every :class:`PendingNeuZipModule` of ``model`` by its frozen compressed module; returns how many.

    Checksums are verified; a corrupted or missing blob raises naming the tensor.
    """
    from safetensors import safe_open

    where = _checkpoint_index(files)
    shared: dict[tuple, CompressedWeight] = {}
    pending = [(n, m) for n, m in model.named_modules() if isinstance(m, PendingNeuZipModule)]
    for name, module in pending:
        prefix = f"{name}.weight."
        keys = [k for k in where if k.startswith(prefix) and "." not in k[len(prefix):]]
        if "header" not in {k[len(prefix):] for k in keys}:
            raise ValueError(f"NeuZip checkpoint has no compressed blobs for {name}.weight")
        blobs = {}
        for key in keys:
            with safe_open(where[key], framework="pt", device="cpu") as handle:
                blobs[key[len(prefix):]] = handle.get_tensor(key)
        # A tied pair was written twice: share one compressed tensor when the bytes are identical.
        identity = tuple(blobs["checksum"].tolist()) + tuple(blobs["header"].tolist())
        weight = shared.get(identity)
        if weight is None or not torch.equal(weight.ct.stream[: weight.ct.stream_words].cpu(),
                                             blobs["stream"].to(torch.int32)):  # the used words (a stream has headroom)
            ct = CompressedTensor.from_state_dict(blobs, name=f"{name}.weight", device=device)
            weight = CompressedWeight(ct, requires_grad=False, name=f"{name}.weight")
            shared[identity] = weight
        if module.kind == "embedding":
            replacement = build_module(module.original, weight, name)
        else:
            bias = module.bias
            if bias is not None:
                bias.requires_grad_(False)
            replacement = CompressedLinear(weight, bias=bias)
        model.set_submodule(name, replacement)
    mark_large_weights(model)
    return len(pending)


class NeuZipHfQuantizer(HfQuantizer):
    """Loads NeuZip exports compressed (see the module docstring for the mechanism)."""

    requires_calibration = True  # only pre-compressed exports: quantizing a dense model on load is not offered

    def __init__(self, quantization_config: NeuZipConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self._files: list[str] | None = None

    def validate_environment(self, *args, **kwargs):
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and len({str(v) for v in device_map.values()}) > 1:
            raise ValueError("NeuZip exports load onto one device; pass device_map=None, 'cpu' or 'cuda'")

    def update_dtype(self, dtype):
        return torch.bfloat16 if dtype is None else dtype

    def update_device_map(self, device_map):
        if device_map is None:
            # Like bitsandbytes: a compressed checkpoint is meant to run on the GPU when there is one.
            device_map = {"": torch.cuda.current_device() if torch.cuda.is_available() else "cpu"}
        return device_map

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):

        self._files = list(checkpoint_files) if checkpoint_files else None
        names = list(self.quantization_config.modules)
        for name in names:
            model.set_submodule(name, PendingNeuZipModule(model.get_submodule(name)))
        if names:
            pattern = rf"^({'|'.join(re.escape(n) for n in names)})\.weight{_BLOB_SUFFIX}$"
            model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or ()) | {pattern}
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        tensors = [t for t in list(model.parameters()) + list(model.buffers()) if not t.is_meta]
        device = tensors[0].device if tensors else torch.device("cpu")
        load_neuzip_modules(model, _checkpoint_files(model, self._files), device)
        chunk_output_head(model)  # inference: the vocabulary-sized head never needs a whole decode buffer
        return model

    def _dequantize(self, model, dtype=None):
        for name, module in list(model.named_modules()):
            if isinstance(module, CompressedLinear):
                dense = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                        device="meta")
                dense.weight = torch.nn.Parameter(module.compressed.dense(), requires_grad=False)
                if module.bias is not None:
                    dense.bias = module.bias
            elif isinstance(module, CompressedEmbedding):
                if module.embed_scale is not None:  # an nn.Embedding would drop the scale
                    raise NotImplementedError(f"{name}: dequantizing a scaled embedding; export with --format hf")
                dense = torch.nn.Embedding(module.num_embeddings, module.embedding_dim, padding_idx=module.padding_idx,
                                           device="meta")
                dense.weight = torch.nn.Parameter(module.compressed.dense(), requires_grad=False)
            else:
                continue
            model.set_submodule(name, dense.to(dtype) if dtype is not None else dense)
        return model

    def is_serializable(self, *args, **kwargs) -> bool:
        # save_pretrained would write the codec blobs without the export's markers: use `neutrain export`.
        return False

    @property
    def is_trainable(self) -> bool:
        return True  # PEFT adapters over the frozen compressed base

    @property
    def is_qat_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return False


def register() -> None:
    """Register ``quant_method: neuzip`` with transformers (idempotent)."""
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(NeuZipConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(NeuZipHfQuantizer)


register()  # whichever imports first, this module or transformers' registry, the method ends up registered
