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
    write_safetensors(unique, out / WEIGHTS_FILE, {"aliases": json.dumps(aliases), "format": "neuzip-blobs"})
    model.config.save_pretrained(str(out))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(out))
    (out / MARKER).write_text(json.dumps({"weights": weights, "format": "neuzip-blobs"}))


def load_compressed_state(model: torch.nn.Module, checkpoint_dir: str | os.PathLike) -> None:
    """Load a checkpoint written by :func:`save_compressed_checkpoint` into a compressed ``model``.

    Every blob's checksum is verified; a corrupted file raises an error naming the tensor.
    One compressed weight at a time: its blobs are read into host memory, checked there and
    copied into the weight's device, so the device never holds a second copy of the model; the dense
    rest (norms, biases, buffers) is copied in from the host by ``load_state_dict``.
    """
    from safetensors import safe_open

    from neutrain.errors import CheckpointError

    path = Path(checkpoint_dir) / WEIGHTS_FILE
    if not path.exists():
        raise CheckpointError(f"checkpoint '{checkpoint_dir}' has no {WEIGHTS_FILE}")
    with safe_open(str(path), framework="pt", device="cpu") as fh:
        aliases = json.loads((fh.metadata() or {}).get("aliases", "{}"))
        loaded = _load_compressed_weights(model, fh, path, aliases)
        state = {k: fh.get_tensor(k) for k in fh.keys() if k.rpartition(".weight.")[0] + ".weight" not in loaded}
    for alias, source in aliases.items():
        if alias.rpartition(".weight.")[0] + ".weight" not in loaded:
            state[alias] = state[source]
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


def _load_compressed_weights(model: torch.nn.Module, handle, path: Path, aliases: dict[str, str]) -> set[str]:
    """Load every compressed module's weight from an open safetensors ``handle``, one weight at a time.

    A weight whose blobs are missing is left to ``load_state_dict``, which names it. Offloaded weights
    (``memory.offload_weights``) go into their host store (``replace_`` -> ``WeightOffload.adopt``).
    Returns the names loaded (``<module>.weight``).
    """
    from neutrain.compress import CompressedTensor
    from neutrain.errors import CheckpointError

    keys = set(handle.keys()) | set(aliases)
    done: set[str] = set()
    placed: set[int] = set()  # a tied lm_head shares the embedding's weight: loaded once
    staged = []  # (name, weight, host copy, device): placed on the device once every old blob is gone
    for name, module in model.named_modules():
        weight = getattr(module, "compressed", None)
        prefix = f"{name}.weight."
        names = [k for k in keys if k.startswith(prefix)]
        if weight is None or not names:
            continue
        done.add(prefix[:-1])
        if id(weight) in placed:
            continue
        placed.add(id(weight))
        blobs = {k[len(prefix):]: handle.get_tensor(aliases.get(k, k)) for k in names}
        device = weight.device
        try:
            loaded = CompressedTensor.from_state_dict(blobs, name=prefix[:-1], device="cpu")  # checked on the host
            if weight.home is not None:  # offloaded: its host store adopts the blobs
                weight.replace_(loaded.to(device))
            else:
                weight.replace_(loaded)  # the host copy stands in (replace_ checks the shape): the old device blobs go
                staged.append((prefix[:-1], weight, loaded, device))
        except (ValueError, RuntimeError) as exc:
            raise CheckpointError(f"checkpoint file '{path}': {prefix[:-1]}: {exc}") from None
        del blobs, loaded
    # Every old blob is gone before the first new one is placed. Replaced one weight at a time, each new blob was
    # allocated among the still-live blobs of the other weights, of slightly other sizes: the CUDA allocator was
    # left with holes it could neither fill nor hand back, and the resumed run's first step ran out of memory at
    # an 11 GiB budget that the uninterrupted run met (Llama-3-8B, 10.06 GiB allocated, 10.95 reserved, twice:
    # freeing each weight's old blobs just before its new ones did not help; benchmarks/notes_cards.md). Placed
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

