"""Putting a model's decoder layers into a :class:`~neutrain.nn.weight_offload.WeightOffload`.

Two ways: :func:`offload_weights` moves the layers of a built compressed model to host memory;
a build with an offloading placement (:class:`neutrain.nn.model_spec.Placement`, ``offload=True``)
moves each layer as soon as its last tensor is placed (:class:`neutrain.nn.sink.ModelSink`), so a
model whose compressed weights exceed the device's memory (the Llama-3-70B on an 80 GB H100) is
never whole on the device.

Either may take some of the layers only (``memory.offload_layers``): a
:class:`~neutrain.config.layer_placement.LayerPlacement` names them, spread evenly through the model, and
the store's ring for them. The layers left out stay on the
device and train exactly as they would with no store (the store only acts on the weights it holds).
"""

from __future__ import annotations

import torch

from neutrain.config.layer_placement import LayerPlacement
from neutrain.nn.weight_offload import WeightOffload

def ring_store(placement: LayerPlacement, device) -> WeightOffload:
    """An empty store with ``placement``'s ring."""
    return WeightOffload(device, ahead=placement.ahead, slots=placement.slots)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's decoder layers: the longest ``ModuleList`` whose every entry holds compressed weights."""
    from neutrain.nn.convert import compressed_weights

    best = _longest_list(model, lambda layer: bool(compressed_weights(layer)))
    if best is None:
        raise ValueError("no decoder layers with compressed weights to offload (memory.weights must be neuzip-lossless)")
    return best


def layer_names(model: torch.nn.Module) -> list[str]:
    """The names of the decoder layers of ``model``, built or a meta-device skeleton: the entries of the
    longest ``ModuleList`` whose every entry holds weights NeuZip compresses (``nn.Linear``, compressed).

    Example:
        >>> from accelerate import init_empty_weights
        >>> from transformers import AutoModelForCausalLM, LlamaConfig
        >>> with init_empty_weights():
        ...     skeleton = AutoModelForCausalLM.from_config(LlamaConfig(num_hidden_layers=2))
        >>> layer_names(skeleton)
        ['model.layers.0', 'model.layers.1']
    """
    from neutrain.nn.convert import compressed_weights

    def holds_weights(layer):
        return bool(compressed_weights(layer)) or any(isinstance(m, torch.nn.Linear) for m in layer.modules())

    best = _longest_list(model, holds_weights)
    if best is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers to offload")
    name = next(n for n, m in model.named_modules() if m is best)
    return [f"{name}.{i}" for i in range(len(best))]


def _longest_list(model: torch.nn.Module, holds) -> torch.nn.ModuleList | None:
    best = None
    for module in model.modules():
        longer = isinstance(module, torch.nn.ModuleList) and len(module) and (best is None or len(module) > len(best))
        if longer and all(holds(layer) for layer in module):
            best = module
    return best


def offload_weights(model: torch.nn.Module, ahead: int = 2, slots: int | None = None,
                    count: int | None = None) -> WeightOffload:
    """Keep ``model``'s decoder layers' compressed weights in host memory, streamed in per layer.

    ``count``: offload that many decoder layers only (:meth:`LayerPlacement.spread`, whose ring then
    replaces ``ahead``, and ``slots`` unless given); None: every layer, with the ring ``ahead`` / ``slots``.

    Returns the :class:`WeightOffload` (also ``model._neutrain_weight_offload``). Embedding and lm_head
    stay on the device. See the module docstring for an example.

    Example:
        >>> from transformers import LlamaConfig, AutoModelForCausalLM
        >>> from neutrain.nn import compress_model
        >>> cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        ...                   num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
        >>> model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        >>> _ = compress_model(model, progress=False, codec_options={"steps": 16})
        >>> store = offload_weights(model, count=2)  # layers 1 and 3
        >>> [layer.weights[0].name.split(".")[2] for layer in store.layers], store.slots
        (['1', '3'], 2)
    """
    from neutrain.nn.convert import compressed_weights

    layers = decoder_layers(model)
    device = compressed_weights(layers[0])[0].device
    if count is None:
        store, chosen = WeightOffload(device, ahead=ahead, slots=slots), range(len(layers))
    else:
        placement = LayerPlacement.spread(len(layers), count, slots)
        store, chosen = ring_store(placement, device), placement.offloaded
    for index in chosen:
        store.add_layer(w for w in compressed_weights(layers[index]) if not w.large)
    return attach(model, store)


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

    from neutrain.storage.digests import Digests, remember

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
    # The manifest's sha256 of each tensor is computed beside the writes from the bytes written, so the
    # manifest does not read the file back (storage/digests.py); the tensors tile the data, so with the
    # header's digest they cover every byte, and no serial sha256 of the whole file bounds the write.
    with open(tmp, "wb") as fh, Digests(whole=False) as digests:
        head = struct.pack("<Q", len(encoded)) + encoded
        fh.write(head)
        digests.add(head)
        for name in names:
            t = tensors[name].detach().contiguous()
            data = memoryview(t.cpu().view(-1).view(torch.uint8).numpy()) if t.numel() else b""
            fh.write(data)
            digests.add(data, name)
        fh.flush()
        whole, sums = digests.result()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    remember(path, whole, sums)
