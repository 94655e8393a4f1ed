"""Optimizer state as safetensors + JSON (neutrain.distributed.state_files): exact round trip, no pickle, clear refusals."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from neutrain.errors import CheckpointError
from neutrain.distributed.state_files import STATE_FORMAT, load_optimizer_state, save_optimizer_state


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(4))]


def _stepped(make, steps: int = 2):
    params = _params()
    opt = make(params)
    for _ in range(steps):
        opt.zero_grad()
        (params[0].square().sum() + params[1].prod()).backward()
        opt.step()
    return params, opt


def _groups(params):
    return [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}]


@pytest.mark.parametrize("make", [lambda p: torch.optim.AdamW(_groups(p), lr=1e-2, betas=(0.8, 0.95)),
                                  lambda p: torch.optim.SGD(_groups(p), lr=0.1, momentum=0.9)], ids=["adamw", "sgd"])
def test_round_trip_continues_bit_for_bit(make, tmp_path):
    params, opt = _stepped(make)
    opt.param_groups[1]["lr"] = 1 / 3  # a float that only an exact (repr) round trip keeps
    path = save_optimizer_state(opt, str(tmp_path / "opt.safetensors"))
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
    again = make(fresh)
    load_optimizer_state(again, path)
    a, b = opt.state_dict(), again.state_dict()
    assert a["param_groups"] == b["param_groups"]  # betas stay a tuple: (0.8, 0.95) != [0.8, 0.95]
    assert list(b["state"]) == list(a["state"])  # integer keys stay integers
    for i, state in a["state"].items():
        for key, value in state.items():
            assert torch.equal(b["state"][i][key], value), key
    for optimizer, ps in ((opt, params), (again, fresh)):  # one more step each: identical weights
        optimizer.zero_grad()
        (ps[0].square().sum() + ps[1].prod()).backward()
        optimizer.step()
    for p, q in zip(params, fresh):
        assert torch.equal(p, q)


def test_non_tensor_state_is_json_in_the_safetensors_header(tmp_path):
    _, opt = _stepped(lambda p: torch.optim.AdamW(_groups(p), lr=1e-2))
    opt.param_groups[0]["lr"] = math.nan
    path = save_optimizer_state(opt, str(tmp_path / "opt.safetensors"))
    raw = open(path, "rb").read()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    meta = header["__metadata__"]
    assert meta["format"] == STATE_FORMAT and meta["optimizer"] == "AdamW"
    tree = json.loads(meta["state"])
    assert "dict" in tree and b"\x80" not in raw[:2]  # no pickle protocol header: nothing to unpickle
    again = torch.optim.AdamW(_groups(_params()), lr=1e-2)
    load_optimizer_state(again, path)
    assert math.isnan(again.param_groups[0]["lr"])


def test_another_optimizer_or_model_is_refused_with_the_file_named(tmp_path):
    _, opt = _stepped(lambda p: torch.optim.AdamW(_groups(p), lr=1e-2))
    path = save_optimizer_state(opt, str(tmp_path / "opt.safetensors"))
    with pytest.raises(CheckpointError, match=r"opt\.safetensors' holds AdamW state; this run's optimizer is SGD"):
        load_optimizer_state(torch.optim.SGD(_params(), lr=0.1), path)
    with pytest.raises(CheckpointError, match="parameter groups do not match"):
        load_optimizer_state(torch.optim.AdamW(_params(), lr=1e-2), path)  # one group, not two


def test_a_tensor_the_state_names_but_the_file_lacks_is_refused(tmp_path):
    _, opt = _stepped(lambda p: torch.optim.AdamW(_groups(p), lr=1e-2))
    path = save_optimizer_state(opt, str(tmp_path / "opt.safetensors"))
    tensors = load_file(path)
    from safetensors import safe_open

    with safe_open(path, framework="pt") as fh:
        meta = fh.metadata()
    tensors.pop("t0")
    save_file(tensors, path, metadata=meta)
    with pytest.raises(CheckpointError, match="names tensor 't0', which the file does not hold"):
        load_optimizer_state(torch.optim.AdamW(_groups(_params()), lr=1e-2), path)


@pytest.mark.parametrize("state", ['{"dict": [[1, 2, 3]]}', '{"dict": [[[1], 2]]}', '{"what": 1}', '[1, 2]'])
def test_malformed_json_state_is_one_clear_error(state, tmp_path):
    path = str(tmp_path / "opt.safetensors")
    save_file({}, path, metadata={"format": STATE_FORMAT, "optimizer": "AdamW", "state": state})
    with pytest.raises(CheckpointError, match=r"opt\.safetensors'"):
        load_optimizer_state(torch.optim.AdamW(_params(), lr=1e-2), path)
