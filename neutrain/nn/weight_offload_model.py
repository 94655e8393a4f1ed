"""Putting a model's decoder layers into a :class:`~neutrain.nn.weight_offload.WeightOffload`.

Two ways: :func:`offload_weights` moves the layers of a built compressed model to host memory;
:func:`streaming_offload` moves each layer as soon as a build (``init_compressed``,
``load_compressed``) has placed its last tensor, so a model whose compressed weights exceed the
device's memory (the Llama-3-70B on an 80 GB H100) is never whole on the device.
"""

from __future__ import annotations

import contextlib
import re

import torch

from neutrain.nn.weight_offload import WeightOffload


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's decoder layers: the longest ``ModuleList`` whose every entry holds compressed weights."""
    from neutrain.nn.convert import compressed_weights

    best = None
    for module in model.modules():
        longer = isinstance(module, torch.nn.ModuleList) and len(module) and (best is None or len(module) > len(best))
        if longer and all(compressed_weights(layer) for layer in module):
            best = module
    if best is None:
        raise ValueError("no decoder layers with compressed weights to offload (memory.weights must be neuzip-lossless)")
    return best


def offload_weights(model: torch.nn.Module, ahead: int = 2, slots: int | None = None) -> WeightOffload:
    """Keep ``model``'s decoder layers' compressed weights in host memory, streamed in per layer.

    Returns the :class:`WeightOffload` (also ``model._neutrain_weight_offload``). Embedding and lm_head
    stay on the device. See the module docstring for an example.
    """
    from neutrain.nn.convert import compressed_weights

    layers = decoder_layers(model)
    device = compressed_weights(layers[0])[0].device
    store = WeightOffload(device, ahead=ahead, slots=slots)
    for layer in layers:
        store.add_layer(w for w in compressed_weights(layer) if not w.large)
    return attach(model, store)


@contextlib.contextmanager
def streaming_offload(device, ahead: int = 2, slots: int | None = None):
    """Build a compressed model (``init_compressed``, ``load_compressed``) with each decoder layer moved to
    host memory as soon as its last tensor is placed: the device never holds more than one layer's payload.

    Yields the :class:`WeightOffload`; attach it with :func:`attach` once the model exists.

    Example:
        >>> from neutrain.nn.load import init_compressed
        >>> from transformers import LlamaConfig
        >>> cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        ...                   num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
        >>> with streaming_offload("cpu") as store:
        ...     model, _ = init_compressed(cfg, device="cpu", progress=False, codec_options={"steps": 16})
        >>> attach(model, store) is store, len(store.layers)
        (True, 2)
    """
    from neutrain.nn.convert import compressed_weights
    from neutrain.nn.load import after_each_tensor

    store = WeightOffload(device, ahead=ahead, slots=slots)
    building: list = []  # [the layer module being built]

    def after(model, name):
        match = _LAYER_NAME.match(name) if name is not None else None
        layer = model.get_submodule(match.group(1))[int(match.group(2))] if match else None
        if building and building[0] is not layer:  # the previous layer is complete
            store.add_layer(w for w in compressed_weights(building.pop()) if not w.large)
        if layer is not None and not building:
            building.append(layer)

    with after_each_tensor(after):
        yield store


_LAYER_NAME = re.compile(r"^(.*\.layers)\.(\d+)\.")


def attach(model: torch.nn.Module, store: WeightOffload) -> WeightOffload:
    """Record ``store`` as ``model``'s weight store (what :func:`weight_store` returns) and return it."""
    model._neutrain_weight_offload = store
    if store.cuda:
        torch.cuda.empty_cache()  # the layers' device payloads are gone: give their segments back
    return store


def weight_store(model: torch.nn.Module) -> WeightOffload | None:
    """The model's :class:`WeightOffload`, or None when its weights are not offloaded."""
    return getattr(model, "_neutrain_weight_offload", None)


_SAFETENSORS_DTYPES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32",
                       torch.int64: "I64", torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
                       torch.float64: "F64"}


def write_safetensors(tensors: dict[str, torch.Tensor], path, metadata: dict[str, str]) -> None:
    """Write a safetensors file one tensor at a time (atomically: a temporary file, fsync, rename).

    ``safetensors.torch.save_file`` builds every tensor's bytes in memory first: for an offloaded 70B
    that is another 88 GiB beside the 88 GiB of pinned layers on a 128 GiB host. Here each (host)
    tensor is written from its own memory, so saving takes no copy of the model.

    Example:
        >>> import tempfile, os
        >>> from safetensors.torch import load_file
        >>> path = os.path.join(tempfile.mkdtemp(), "t.safetensors")
        >>> write_safetensors({"a": torch.arange(3), "b": torch.ones(2, dtype=torch.bfloat16)}, path, {"k": "v"})
        >>> load_file(path)["a"].tolist()
        [0, 1, 2]
    """
    import json
    import os
    import struct

    names = sorted(tensors)
    header: dict = {"__metadata__": dict(metadata)}
    offset = 0
    for name in names:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as save_file writes it
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(struct.pack("<Q", len(encoded)))
        fh.write(encoded)
        for name in names:
            t = tensors[name].detach().contiguous()
            if t.numel():
                fh.write(memoryview(t.cpu().view(-1).view(torch.uint8).numpy()))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
