"""A checkpoint's weights into a model, whichever of the two lossless formats each is in.

Why: lossless NeuZip and dense weights hold the same values, so a run may switch between them at a resume
(``memory.weights: auto`` resolves to dense on a card that holds the model dense, to NeuZip on one that does
not). :func:`load_weights` is the one reader a resume goes through: a compressed checkpoint's blobs go into a
compressed model as they are (:func:`~neutrain.nn.checkpoint.load_compressed_state`, bit for bit); across the
formats each weight is decoded (compressed checkpoint, dense model) or encoded (dense checkpoint, compressed
model) on the way, one tensor at a time, so neither side ever holds a second copy of the model.

Example:
    >>> load_weights(model, "outputs/run/checkpoint-20")  # doctest: +SKIP
    True
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from neutrain.compress import CompressedTensor
from neutrain.errors import CheckpointError
from neutrain.nn.checkpoint import WEIGHTS_FILE, is_compressed, load_compressed_state
from neutrain.nn.checkpoint_reader import read_weights
from neutrain.nn.formats import folder_format
from neutrain.nn.sources import SafetensorsFolder
from neutrain.optim.fused import COMPRESSED_KEY_ATTR


def load_weights(model: torch.nn.Module, checkpoint_dir: str | os.PathLike) -> bool:
    """Read a checkpoint's weights into ``model``, dense or compressed, whichever format the checkpoint has
    (see the module docstring). Returns False, reading nothing, where the checkpoint and the model are both
    dense: the Trainer's own loading reads those (adapters and shards included).

    Raises:
        CheckpointError: a tensor the model lacks, a weight the checkpoint lacks, or weights of another dtype
            than the model stores (a dense fp32 run and bf16 NeuZip do not train the same model).
    """
    compressed_checkpoint = folder_format(checkpoint_dir).resumable  # a compressed run's blobs, resumed as they are
    if compressed_checkpoint and is_compressed(model):
        load_compressed_state(model, checkpoint_dir)
        return True
    if not compressed_checkpoint and not is_compressed(model):
        return False
    _load_across(model, Path(checkpoint_dir), _compressed_tensors if compressed_checkpoint else _dense_tensors)
    return True


def _dense_tensors(directory: Path):
    """``(name, tensor)`` of a dense (Hugging Face) checkpoint, shard by shard."""
    folder = SafetensorsFolder(directory)
    yield from folder.tensors(None, "cpu", torch.bfloat16)


def _compressed_tensors(directory: Path):
    """``(name, dense tensor)`` of a compressed checkpoint: each weight's blobs checked and decoded."""
    path = directory / WEIGHTS_FILE
    for name, value in read_weights(path):
        if not isinstance(value, dict):
            yield name, value
            continue
        try:
            yield name, CompressedTensor.from_state_dict(value, name=name, device="cpu").decompress()
        except (ValueError, RuntimeError, KeyError) as exc:
            raise CheckpointError(f"checkpoint file '{path}': {name}: {exc}") from None


def _load_across(model: torch.nn.Module, directory: Path, tensors) -> None:
    """Write each of ``tensors(directory)`` into the model's dense parameter or compressed weight of its name."""
    weights = {f"{n}.weight": m.compressed for n, m in model.named_modules() if getattr(m, "compressed", None) is not None}
    # A compressed weight's placeholder parameter is the optimizer's key, not a tensor a checkpoint holds.
    params = {n: p for n, p in model.named_parameters(remove_duplicate=False) if not getattr(p, COMPRESSED_KEY_ATTR, False)}
    wanted = {id(w): n for n, w in weights.items()} | {id(p): n for n, p in params.items()}  # buffers are optional
    params.update(dict(model.named_buffers()))
    done: set[int] = set()
    for name, tensor in tensors(directory):
        target = weights.get(name)
        if target is None and name not in params:
            raise CheckpointError(f"checkpoint '{directory}': tensor {name} has no place in this model")
        stored = target.dtype if target is not None else params[name].dtype
        shape = tuple(target.shape) if target is not None else tuple(params[name].shape)
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"checkpoint '{directory}': {name} has shape {tuple(tensor.shape)}; the model needs {shape}")
        if tensor.is_floating_point() and tensor.dtype != stored:
            raise CheckpointError(
                f"checkpoint '{directory}': {name} is stored in {str(tensor.dtype).removeprefix('torch.')}, this run's "
                f"weights in {str(stored).removeprefix('torch.')}: dense and NeuZip weights resume into each other only "
                "in one dtype; resume with the checkpoint's memory.weights, or set model.dtype to its dtype")
        with torch.no_grad():
            if target is not None:
                if id(target) not in done:  # a tied lm_head shares the embedding's compressed weight
                    target.write_(tensor.to(target.device))
                done.add(id(target))
            else:
                params[name].copy_(tensor)
                done.add(id(params[name]))
        del tensor
    missing = sorted(n for i, n in wanted.items() if i not in done)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint '{directory}' has no {missing[0]}{more}")
