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

MARKER = "neutrain_weights.json"
WEIGHTS_FILE = "model.safetensors"


def is_compressed(model: torch.nn.Module) -> bool:
    """True when ``model`` holds NeuZip-compressed modules."""
    from neutrain.nn import CompressedEmbedding, CompressedLinear

    return any(isinstance(m, (CompressedLinear, CompressedEmbedding)) for m in model.modules())


def save_compressed_checkpoint(model: torch.nn.Module, output_dir: str | os.PathLike, weights: str) -> None:
    """Write the model's compressed state dict, config and marker into ``output_dir``."""
    from safetensors.torch import save_file

    from neutrain.nn.weight_offload_model import weight_store, write_safetensors

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
        unique[name] = tensor.detach().contiguous().cpu()
    metadata = {"aliases": json.dumps(aliases), "format": "neuzip-blobs"}
    if weight_store(model) is not None:  # memory.offload_weights: the layers are views of host memory
        write_safetensors(unique, out / WEIGHTS_FILE, metadata)  # tensor by tensor, no copy of the model
    else:
        save_file(unique, str(out / WEIGHTS_FILE), metadata=metadata)
    model.config.save_pretrained(str(out))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(out))
    (out / MARKER).write_text(json.dumps({"weights": weights, "format": "neuzip-blobs"}))


def load_compressed_state(model: torch.nn.Module, checkpoint_dir: str | os.PathLike) -> None:
    """Load a checkpoint written by :func:`save_compressed_checkpoint` into a compressed ``model``.

    Every blob's checksum is verified; a corrupted file raises an error naming the tensor.
    """
    from safetensors import safe_open

    from neutrain.errors import CheckpointError

    path = Path(checkpoint_dir) / WEIGHTS_FILE
    if not path.exists():
        raise CheckpointError(f"checkpoint '{checkpoint_dir}' has no {WEIGHTS_FILE}")
    from neutrain.nn.weight_offload_model import load_offloaded_blobs, weight_store

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    with safe_open(str(path), framework="pt", device="cpu") as fh:
        aliases = json.loads((fh.metadata() or {}).get("aliases", "{}"))
        # memory.offload_weights: the layers go one by one into host memory, never all read at once.
        offloaded = load_offloaded_blobs(model, fh, path) if weight_store(model) is not None else set()
        state = {k: fh.get_tensor(k) for k in fh.keys() if k.rpartition(".weight.")[0] + ".weight" not in offloaded}
    for alias, source in aliases.items():
        state[alias] = state[source]
    try:
        result = model.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=not offloaded)
        left = [k for k in result.missing_keys if k not in offloaded] + list(result.unexpected_keys)
        if left:
            raise RuntimeError("\n" + "\n".join(f"{'missing' if k in result.missing_keys else 'unexpected'} key: {k}"
                                                 for k in left))
    except RuntimeError as exc:
        # torch's first line only names the model class; the tensors and reasons follow, one per line.
        lines = [line.strip() for line in str(exc).splitlines()[1:] if line.strip()] or [str(exc).strip()]
        more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
        raise CheckpointError(f"checkpoint file '{path}': {lines[0]}{more}") from None
    del result
