"""The one reader (and writer of the metadata) of a compressed checkpoint's weights file.

A ``checkpoint-N`` of a compressed run holds its weights in one safetensors file: each compressed weight as
the codec's blobs under ``<parameter>.<blob>`` (a linear's ``<module>.weight``, an expert stack's own name), dense tensors (norms, biases) under their own names, and
tensors that share storage (a tied lm_head) once, the others named in the file's metadata as aliases of it.

Why one module: a build from the checkpoint (:class:`neutrain.nn.sources.NeutrainCheckpoint`), a resume
into a compressed model (:func:`neutrain.nn.checkpoint.load_compressed_state`) and a resume across formats
(:mod:`neutrain.nn.checkpoint_weights`) each parsed the aliases and grouped the blobs themselves, three
parsers of one format that had to agree. :func:`read_weights` is the one; :func:`weights_metadata` writes
what it reads.

Example:
    >>> for name, value in read_weights("outputs/run/checkpoint-20/model.safetensors"):  # doctest: +SKIP
    ...     print(name, type(value).__name__)  # 'Tensor' for a dense tensor, 'dict' for a weight's blobs
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import torch

from neutrain.compress.format import BLOB_KEYS
from neutrain.errors import CheckpointError

WEIGHTS_FILE = "model.safetensors"
_ALIASES = "aliases"  # metadata key: {alias name: the name its tensor is saved under}
BLOB_FORMAT = "neuzip-blobs"
_BLOBS = frozenset((*BLOB_KEYS, "checksum", "name"))  # what a compressed tensor's state dict holds


def weights_metadata(aliases: dict[str, str]) -> dict[str, str]:
    """The metadata :func:`read_weights` reads back: ``aliases`` (each name whose tensor is saved under another)."""
    return {_ALIASES: json.dumps(aliases), "format": BLOB_FORMAT}


def blob_owner(name: str) -> str | None:
    """The weight ``name`` would be a codec blob of (``<parameter>.<blob>``, by the blob's name), or None.

    Example:
        >>> blob_owner("model.layers.0.mlp.up_proj.weight.stream"), blob_owner("model.norm.weight")
        ('model.layers.0.mlp.up_proj.weight', None)
    """
    owner, _, blob = name.rpartition(".")
    return owner if owner and blob in _BLOBS else None


def read_weights(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor | dict[str, torch.Tensor]]]:
    """Every weight of the checkpoint weights file ``path`` once, on the host, aliases resolved (a tied weight
    comes under each of its names, from the one saved copy): ``(name, dense tensor)``, or
    ``(<module>.weight, {blob name: tensor})`` for a compressed weight, its blobs not yet checked (the
    checksum is the consumer's ``CompressedTensor.from_state_dict``). One weight is read at a time.

    Raises:
        CheckpointError: the file is missing, or its alias metadata is not a mapping of names.
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint '{path.parent}' has no {path.name}")
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        try:
            aliases = json.loads((handle.metadata() or {}).get(_ALIASES, "{}"))
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"checkpoint file '{path}': its {_ALIASES} metadata is not JSON ({exc})") from None
        if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
            raise CheckpointError(f"checkpoint file '{path}': its {_ALIASES} metadata is not a mapping of names")
        groups: dict[str, list[str]] = {}  # in file order, aliases last
        for key in [*handle.keys(), *aliases]:
            groups.setdefault(blob_owner(key) or key, []).append(key)
        for name, keys in groups.items():
            if keys == [name]:
                yield name, handle.get_tensor(aliases.get(name, name))
            elif f"{name}.checksum" in keys:  # a sealed compressed tensor's blobs
                yield name, {key[len(name) + 1:]: handle.get_tensor(aliases.get(key, key)) for key in keys}
            else:  # dense tensors whose names merely end like blobs
                for key in keys:
                    yield key, handle.get_tensor(aliases.get(key, key))
