"""Optimizer state as one safetensors file per rank: the tensors as tensors, the rest as JSON. No pickle.

An optimizer's ``state_dict()`` is a tree of dicts (integer keys included),
lists, tuples, numbers, strings and tensors. ``torch.save`` would pickle the
tree; even a ``weights_only=True`` load runs an unpickler over it. Here every
tensor goes into a safetensors file and the tree around it is written as JSON
in the file's metadata (``__metadata__["state"]``), tagged so that it reads back
exactly: integer dict keys stay integers, tuples stay tuples, floats keep every
bit (``repr`` round-trips; NaN and infinities are JSON extensions Python reads).

Sharded runs (FSDP2) hold an ordinary optimizer's moments as ``DTensor``: each
rank writes its local shard (``to_local()``), marked as such, and on load the
shard is wrapped again with its parameter's mesh and placements, so the
optimizer continues bit for bit. The fused optimizers hold local tensors already.

Example:
    >>> opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    >>> save_optimizer_state(opt, "/tmp/optimizer.safetensors")        # doctest: +SKIP
    >>> load_optimizer_state(opt, "/tmp/optimizer.safetensors")        # doctest: +SKIP
"""

from __future__ import annotations

import json
from typing import Any

import torch

from neutrain.errors import CheckpointError

STATE_FORMAT = "neutrain-optimizer-state-1"


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return None
    return DTensor


def encode_tree(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The JSON form of ``obj``; its tensors are added to ``tensors`` (CPU, contiguous copies) under ``t<n>``."""
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        dtensor = hasattr(obj, "to_local")
        local = obj.to_local() if dtensor else obj
        tensors[key] = local.detach().to("cpu", copy=True).contiguous()
        return {"tensor": key, "dtensor": dtensor}
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in obj):
            raise TypeError(f"optimizer state has a dict key that is not a string or an integer: {list(obj)[:3]}")
        return {"dict": [[k, encode_tree(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"tuple": [encode_tree(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [encode_tree(v, tensors) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"optimizer state holds a {type(obj).__name__}, which neutrain does not write (no pickle)")


def decode_tree(node: Any, tensors: dict[str, torch.Tensor], path: str, marked: list) -> Any:
    """Inverse of :func:`encode_tree`; ``marked`` collects ``(dict, key)`` of the tensors that were DTensor shards."""
    if isinstance(node, list):
        return [decode_tree(v, tensors, path, marked) for v in node]
    if not isinstance(node, dict):
        return node
    if "tensor" in node:
        if node["tensor"] not in tensors:
            raise CheckpointError(f"checkpoint file '{path}': its state names tensor '{node['tensor']}', which the "
                                  f"file does not hold")
        return tensors[node["tensor"]]
    if "tuple" in node:
        return tuple(decode_tree(v, tensors, path, marked) for v in node["tuple"])
    if "dict" in node:
        out: dict = {}
        for key, value in node["dict"]:
            out[key] = decode_tree(value, tensors, path, marked)
            if isinstance(value, dict) and value.get("dtensor"):
                marked.append((out, key))
        return out
    raise CheckpointError(f"checkpoint file '{path}': malformed optimizer state (an unknown node {sorted(node)[:3]})")


def _inner(optimizer):
    """The torch optimizer behind Accelerate's ``AcceleratedOptimizer`` wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def save_state(tree: dict, path: str, kind: str, metadata: dict[str, str] | None = None) -> str:
    """Write a state tree (see the module doc) to ``path``; ``kind`` names what wrote it (checked at load)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    encoded = encode_tree(tree, tensors)
    save_file(tensors, path, metadata={**(metadata or {}), "format": STATE_FORMAT, "optimizer": kind,
                                       "state": json.dumps(encoded)})
    return path


def save_optimizer_state(optimizer, path: str, metadata: dict[str, str] | None = None) -> str:
    """Write ``optimizer.state_dict()`` to ``path`` as safetensors plus JSON (see the module doc); returns ``path``."""
    optimizer = _inner(optimizer)
    return save_state(optimizer.state_dict(), path, type(optimizer).__name__, metadata)


def read_optimizer_state(path: str) -> tuple[dict, list, dict[str, str]]:
    """``(state dict, DTensor-marked entries, file metadata)`` of a file :func:`save_optimizer_state` wrote."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt", device="cpu") as fh:
            meta = fh.metadata() or {}
            tensors = {name: fh.get_tensor(name) for name in fh.keys()}
        tree = json.loads(meta["state"]) if meta.get("format") == STATE_FORMAT else None
    except (OSError, KeyError, ValueError, SafetensorError) as exc:
        raise CheckpointError(f"checkpoint file '{path}' is not a neutrain optimizer state file ({exc})") from None
    if tree is None:
        raise CheckpointError(f"checkpoint file '{path}' is not a neutrain optimizer state file (format "
                              f"{meta.get('format')!r}, expected {STATE_FORMAT!r})")
    marked: list = []
    try:
        state = decode_tree(tree, tensors, path, marked)
    except CheckpointError:
        raise
    except (TypeError, ValueError):  # a "dict" entry that is not a [key, value] pair, an unhashable key
        raise CheckpointError(f"checkpoint file '{path}': malformed optimizer state in its JSON") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint file '{path}': malformed optimizer state (not a mapping)")
    return state, marked, meta


def check_kind(meta: dict[str, str], kind: str, path: str) -> None:
    """Refuse state written by another optimizer (``kind`` as :func:`save_state` recorded it)."""
    if meta.get("optimizer") != kind:
        raise CheckpointError(f"checkpoint file '{path}' holds {meta.get('optimizer')} state; this run's optimizer "
                              f"is {kind} (train.optimizer must match the run that wrote it)")


def load_optimizer_state(optimizer, path: str) -> None:
    """Load what :func:`save_optimizer_state` wrote into ``optimizer`` (the same optimizer class and parameters)."""
    state, marked, meta = read_optimizer_state(path)
    optimizer = _inner(optimizer)
    check_kind(meta, type(optimizer).__name__, path)
    if not {"state", "param_groups"} <= state.keys():
        raise CheckpointError(f"checkpoint file '{path}': optimizer state without 'state' and 'param_groups'")
    groups, saved_groups = optimizer.param_groups, state["param_groups"]
    if len(groups) != len(saved_groups) or any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
        raise CheckpointError(f"checkpoint file '{path}': its parameter groups do not match this run's optimizer "
                              f"(a different model, or train.weight_decay grouping)")
    if marked:
        _wrap_shards(state, groups, marked, path)
    optimizer.load_state_dict(state)


def _wrap_shards(state: dict, groups: list, marked: list, path: str) -> None:
    """Make the saved local shards ``DTensor`` again, laid out as the parameters they belong to."""
    DTensor = _dtensor_type()
    owner = {}  # id of a per-parameter state dict -> the parameter (saved ids map to params in order, as torch does)
    saved_ids = [i for g in state["param_groups"] for i in g["params"]]
    params = [p for g in groups for p in g["params"]]
    for saved_id, param in zip(saved_ids, params):
        entry = state["state"].get(saved_id)
        if isinstance(entry, dict):
            owner[id(entry)] = param
    for container, key in marked:
        param = owner.get(id(container))
        local = container[key]
        if DTensor is None or not isinstance(param, DTensor):
            raise CheckpointError(f"checkpoint file '{path}': sharded optimizer state '{key}' for a parameter "
                                  f"that is not sharded in this run")
        if local.shape != param.to_local().shape:
            raise CheckpointError(f"checkpoint file '{path}': optimizer state '{key}' has shape {tuple(local.shape)}, "
                                  f"this rank's shard is {tuple(param.to_local().shape)}")
        local = local.to(param.to_local().device)
        container[key] = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                            shape=param.shape, stride=param.stride())

