"""The sharding seam: the optimizer reaches shards only through an injected ``Sharding``."""

import copy

import pytest
import torch

from neutrain.optim import LOMO, AdaLomo, DenseWeightIO
from tests.unit.optim.optim_helpers import batches, loss_fn, make_mlp


class RecordingShards:
    """Declares every matrix a shard of one group (None: no collective) and hands back the whole tensor."""

    def __init__(self):
        self.local, self.numel = [], []

    def shard_groups(self, params):
        return {p: None for p in params if p.dim() >= 2}

    def local_shard(self, param, grad, group):
        self.local.append(param)
        return grad, DenseWeightIO(param)

    def submit_local_shard(self, queue, param, grad, group, finish):
        return False

    def full_numel(self, param):
        self.numel.append(param)
        return param.numel()


def _train(model, opt, steps=3):
    for batch in batches(steps):
        opt.backward(loss_fn(model, batch))
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("cls", [LOMO, AdaLomo])
def test_injected_sharding_routes_the_shards_and_changes_no_number(cls):
    plain_model = make_mlp()
    sharded_model = copy.deepcopy(plain_model)
    plain = cls(plain_model.parameters(), lr=1e-2, clip_mode="per_tensor", max_grad_norm=1.0).bind(plain_model)
    shards = RecordingShards()
    sharded = cls(sharded_model.parameters(), lr=1e-2, clip_mode="per_tensor", max_grad_norm=1.0,
                  sharding=shards).bind(sharded_model)
    assert len(plain.shards) == 0 and len(sharded.shards) == 3  # the three weight matrices
    expected, got = _train(plain_model, plain), _train(sharded_model, sharded)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    matrices = [p for p in sharded_model.parameters() if p.dim() >= 2]
    assert len(shards.local) == 3 * len(matrices) and set(shards.local) == set(matrices)
    # AdaLomo's whole-tensor statistics ask the backend for the whole tensor's size; LOMO needs none.
    assert (set(shards.numel) == set(matrices)) if cls is AdaLomo else not shards.numel


def test_without_injection_nothing_is_a_shard_and_streaming_stays_possible():
    model = make_mlp()
    opt = LOMO(model.parameters(), lr=1e-2).bind(model)
    weight = model[0].weight
    assert len(opt.shards) == 0 and opt.streamed_chunk_rows(weight, weight.shape) is not None
    sharded = LOMO(model.parameters(), lr=1e-2, sharding=RecordingShards()).bind(model)
    assert sharded.streamed_chunk_rows(weight, weight.shape) is None  # a shard's full gradient is reduced first
