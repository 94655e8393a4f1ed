"""Activation offload: the checkpointed layers' saved inputs go to host memory and training is unchanged."""

import copy

import pytest
import torch

from neutrain.nn import causal_lm_loss, decompressed_state_dict
from neutrain.nn.offload import STATS, HostStash, offload_checkpointed_inputs
from neutrain.optim import LOMO

from .nn_helpers import dense_and_compressed, enable_checkpointing, token_batches, tiny_llama


def _train(model, data, offload):
    enable_checkpointing(model)
    if offload:
        assert offload_checkpointed_inputs(model) == 2
    opt = LOMO(model.parameters(), lr=0.1, stochastic_rounding=False, clip_mode="per_tensor", max_grad_norm=1.0)
    opt.bind(model)
    for ids in data:
        opt.backward(causal_lm_loss(model, ids, ids))
        opt.step()
    return decompressed_state_dict(model)


@pytest.mark.slow
@pytest.mark.parametrize("compressed", [False, True], ids=["dense", "neuzip"])
def test_offloaded_checkpoints_train_bit_identically(compressed):
    dense, packed = dense_and_compressed()
    model = packed if compressed else dense
    twin = copy.deepcopy(model)
    data = token_batches(2, seed=9)
    a = _train(model, data, offload=False)
    STATS.reset()
    b = _train(twin, data, offload=True)
    assert STATS.calls == 2 * len(data)  # each layer's forward went through the offloading checkpoint
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_offload_wraps_each_checkpoint_once_and_keeps_its_options():
    model = tiny_llama()
    with pytest.raises(ValueError, match="gradient_checkpointing"):
        offload_checkpointed_inputs(model)  # nothing checkpointed yet
    enable_checkpointing(model)
    offload_checkpointed_inputs(model)
    first = model.model.layers[0]._gradient_checkpointing_func
    assert offload_checkpointed_inputs(model) == 2 and model.model.layers[0]._gradient_checkpointing_func is first
    assert first.keywords.get("use_reentrant") is False


def test_host_stash_keeps_host_tensors_where_they_are():
    # (Device tensors going to host memory and back: test_offload_frees_the_saved_inputs_on_the_gpu.)
    stash = HostStash()
    x = torch.randn(4, 3, requires_grad=True)
    with stash:
        y = (x * x).sum()  # saves x (a host tensor): kept as it is
    y.backward()
    assert stash.packed == 0 and torch.equal(x.grad, 2 * x)


@pytest.mark.gpu
def test_offload_frees_the_saved_inputs_on_the_gpu():
    results = {}
    for offload in (False, True):
        torch.manual_seed(0)
        model = tiny_llama(hidden=512, layers=4).cuda()
        enable_checkpointing(model)
        if offload:
            offload_checkpointed_inputs(model)
        ids = torch.randint(0, 256, (4, 1024), device="cuda")
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        loss = causal_lm_loss(model, ids, ids)
        held = torch.cuda.memory_allocated() - base  # what the forward keeps for backward
        loss.backward()
        results[offload] = (held, {n: p.grad.clone() for n, p in model.named_parameters()})
    inputs = 4 * 4 * 1024 * 512 * 2  # layers x tokens x hidden x bf16
    assert results[False][0] - results[True][0] >= 0.9 * inputs, (results[False][0], results[True][0])
    for name, grad in results[False][1].items():
        assert torch.equal(grad, results[True][1][name]), name
