"""Checkpoints of compressed models: the NeuZip blobs as they are, in one safetensors file.

Why not ``save_pretrained``: a compressed model's state dict holds the codec's
blobs (plain tensors with checksums), not dense weights, and transformers'
saving machinery would try to treat them as weights (tying, conversion). Here
the blobs are saved as they are, tied weights once (``aliases`` in the file's
metadata), beside ``config.json`` and a ``neutrain_weights.json`` marker, so
that a resumed run restores the exact compressed bytes and continues bit for
bit. ``neutrain export`` turns such a checkpoint into a dense model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from neutrain.nn.checkpoint_reader import BLOB_FORMAT, WEIGHTS_FILE, read_weights, weights_metadata

MARKER = "neutrain_weights.json"
__all__ = ["MARKER", "WEIGHTS_FILE", "is_compressed", "load_compressed_state", "save_compressed_checkpoint"]


def is_compressed(model: torch.nn.Module) -> bool:
    """True when ``model`` holds NeuZip-compressed modules."""
    from neutrain.nn import CompressedEmbedding, CompressedLinear

    return any(isinstance(m, (CompressedLinear, CompressedEmbedding)) for m in model.modules())


def save_compressed_checkpoint(model: torch.nn.Module, output_dir: str | os.PathLike, weights: str) -> None:
    """Write the model's compressed state dict, config and marker into ``output_dir``.

    Tensor by tensor: ``model.state_dict()`` holds views of the model's own blobs (the
    codec's checksums are hashed where the blobs lie, with scratch of 1/64 of a blob), and the file is
    written one tensor at a time, each copied to the host just before it is written. So saving takes
    no second copy of the model, on the device or on the host.
    """
    from neutrain.nn.weight_offload_model import write_safetensors

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tensor.numel(), tensor.dtype, tuple(tensor.shape)) if tensor.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]  # tied weights share storage: save once
            continue
        if key is not None:
            seen[key] = name
        unique[name] = tensor.detach()
    del state
    write_safetensors(unique, out / WEIGHTS_FILE, weights_metadata(aliases))
    model.config.save_pretrained(str(out))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(out))
    (out / MARKER).write_text(json.dumps({"weights": weights, "format": BLOB_FORMAT}))


def load_compressed_state(model: torch.nn.Module, checkpoint_dir: str | os.PathLike) -> None:
    """Load a checkpoint written by :func:`save_compressed_checkpoint` into a compressed ``model``.

    Every blob's checksum is verified; a corrupted file raises an error naming the tensor.
    One compressed weight at a time: its blobs are read into host memory, checked there and
    copied into the weight's device, so the device never holds a second copy of the model; the dense
    rest (norms, biases, buffers) is copied in from the host by ``load_state_dict``.
    """
    from neutrain.errors import CheckpointError

    path = Path(checkpoint_dir) / WEIGHTS_FILE
    modules = {f"{n}.weight": m.compressed for n, m in model.named_modules() if getattr(m, "compressed", None) is not None}
    state: dict[str, torch.Tensor] = {}
    loaded = _load_compressed_weights(modules, _rest_into(state, modules, read_weights(path)), path)
    try:
        result = model.load_state_dict(state, strict=False)
        left = [k for k in result.missing_keys if k not in loaded] + list(result.unexpected_keys)
        if left:
            raise RuntimeError("\n" + "\n".join(f"{'missing' if k in result.missing_keys else 'unexpected'} key: {k}"
                                                 for k in left))
    except RuntimeError as exc:
        # torch's first line only names the model class; the tensors and reasons follow, one per line.
        lines = [line.strip() for line in str(exc).splitlines()[1:] if line.strip()] or [str(exc).strip()]
        more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
        raise CheckpointError(f"checkpoint file '{path}': {lines[0]}{more}") from None
    del result


def _rest_into(state: dict[str, torch.Tensor], modules: dict, weights):
    """The pairs of ``weights`` (the reader's) whose blobs go into a compressed module of ``modules``; every other
    tensor is put into ``state`` on the way, for ``load_state_dict`` (which names blobs with no place in the model)."""
    for name, value in weights:
        if isinstance(value, dict) and name in modules:
            yield name, value
        elif isinstance(value, dict):
            state.update({f"{name}.{blob}": tensor for blob, tensor in value.items()})
        else:
            state[name] = value


def _load_compressed_weights(modules: dict, weights, path: Path) -> set[str]:
    """Load each compressed weight of ``modules`` (``<module>.weight`` -> its weight) from ``weights``
    (``(name, blobs)`` pairs), one weight at a time. Offloaded weights (``memory.offload_weights``) go into their host store (``replace_`` ->
    ``WeightOffload.adopt``). Returns the names loaded (``<module>.weight``).
    """
    from neutrain.compress import CompressedTensor
    from neutrain.errors import CheckpointError

    done: set[str] = set()
    placed: set[int] = set()  # a tied lm_head shares the embedding's weight: loaded once
    staged = []  # (name, weight, host copy, device): placed on the device once every old blob is gone
    for name, blobs in weights:
        weight = modules[name]
        done.add(name)
        if id(weight) in placed:
            continue
        placed.add(id(weight))
        device = weight.device
        try:
            loaded = CompressedTensor.from_state_dict(blobs, name=name, device="cpu")  # checked on the host
            if weight.home is not None:  # offloaded: its host store adopts the blobs
                weight.replace_(loaded.to(device))
            else:
                weight.replace_(loaded)  # the host copy stands in (replace_ checks the shape): the old device blobs go
                staged.append((name, weight, loaded, device))
        except (ValueError, RuntimeError) as exc:
            raise CheckpointError(f"checkpoint file '{path}': {name}: {exc}") from None
        del blobs, loaded
    # Every old blob is gone before the first new one is placed. Replaced one weight at a time, each new blob was
    # allocated among the still-live blobs of the other weights, of slightly other sizes: the CUDA allocator was
    # left with holes it could neither fill nor hand back, and the resumed run's first step ran out of memory at
    # an 11 GiB budget that the uninterrupted run met (Llama-3-8B, 10.06 GiB allocated, 10.95 reserved, twice:
    # freeing each weight's old blobs just before its new ones did not help; benchmarks/cards/NOTES.md). Placed
    # after an empty cache, the blobs lie as a fresh build lays them. The host holds the compressed weights
    # meanwhile (10.2 GiB for the 8B).
    if staged and torch.cuda.is_available():
        torch.cuda.empty_cache()
    for label, weight, loaded, device in staged:
        try:
            weight.replace_(loaded.to(device))
        except (ValueError, RuntimeError) as exc:
            raise CheckpointError(f"checkpoint file '{path}': {label}: {exc}") from None
    return done

