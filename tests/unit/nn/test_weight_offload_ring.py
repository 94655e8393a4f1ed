"""Weight offload with many layers through few slots: wrap-around, unequal payloads, recompute, debug checks.

The Llama-3-8B's offloaded step (32 layers through 4 slots, activations offloaded too) faulted on the
GPU where the 5-layer test passed; these tests drive the ring the way the 8B does (on CPU here, on
CUDA in ``test_weight_offload_gpu.py`` with the same helpers).
"""

import pytest
import torch

from neutrain.compress import compress
from neutrain.nn import CompressedWeight, causal_lm_loss, compress_model
from neutrain.nn.offload import offload_checkpointed_inputs
from neutrain.nn.offload_debug import OffloadFaultError
from neutrain.nn.weight_offload import WeightOffload
from neutrain.nn.weight_offload_model import offload_weights
from neutrain.optim import LOMO

from .nn_helpers import CODEC, enable_checkpointing, tiny_llama, token_batches

WIDE_EVERY = 3  # every third layer gets far more exponent entropy: a larger payload than its neighbours


def unequal_llama(layers=12, hidden=64, device="cpu", codec=CODEC):
    """A compressed tiny Llama whose layers' payloads differ in size (a slot must regrow for the wide ones)."""
    model = tiny_llama(seed=11, layers=layers, hidden=hidden)
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            if index % WIDE_EVERY == 1:
                for module in layer.modules():
                    if isinstance(module, torch.nn.Linear):
                        cols = module.weight.shape[1]
                        # Shrink columns by 2^0..2^-11: 12 more exponents in use; the values only get smaller.
                        scale = torch.exp2(-torch.randint(0, 12, (cols,), generator=g).float())
                        module.weight.mul_(scale.to(module.weight.dtype))
    model = model.to(device)
    compress_model(model, progress=False, codec_options=codec)
    enable_checkpointing(model)
    offload_checkpointed_inputs(model)  # the 8B run offloads the saved layer inputs too
    return model


def train_steps(model, data, device="cpu"):
    opt = LOMO(model.parameters(), lr=0.05, stochastic_rounding=False, clip_mode="per_tensor",
               max_grad_norm=1.0).bind(model)
    for ids in data:
        ids = ids.to(device)
        opt.backward(causal_lm_loss(model, ids, ids))
        opt.step()
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def assert_same(expected, got):
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


@pytest.fixture(scope="module")
def plain_run():
    data = token_batches(3, seed=13)
    return data, train_steps(unequal_llama(), data)


@pytest.mark.parametrize(("slots", "ahead", "debug"), [(2, 1, True), (4, 2, False)],
                         ids=["2-slots-sync-debug", "4-slots"])
@pytest.mark.slow
def test_many_layers_through_few_slots_train_bit_identically(plain_run, slots, ahead, debug):
    data, expected = plain_run
    model = unequal_llama()
    store = offload_weights(model, ahead=ahead, slots=slots)
    store.sync_debug = debug  # every fetch and write-back compares the slot with the host bytes
    sizes = {sum(t.numel() for w in layer.weights for t in w._host.values()) for layer in store.layers}
    assert len(sizes) > 1  # the layers' payloads differ, so a slot's size depends on who held it
    got = train_steps(model, data)
    assert_same(expected, got)
    layers = len(store.layers)
    # Forward up, recompute and backward down, every step: the ring wraps many times each way.
    assert store.stats.loads >= len(data) * 2 * (layers - slots)
    assert store.stats.writebacks == len(data) * 7 * layers
    assert store.stats.regrows >= 1  # a wide layer landed in a slot sized for a narrow one
    assert sum(layer.slot is not None for layer in store.layers) <= slots
    owners = [layer for layer in store.layers if layer.slot is not None]
    assert all(store._owner[layer.slot] is layer for layer in owners)  # the ring's two views agree


@pytest.mark.slow
def test_looking_further_ahead_than_the_slots_hold_does_not_thrash():
    model = unequal_llama()
    store = offload_weights(model, ahead=2, slots=2)
    train_steps(model, token_batches(1, seed=14))
    # Each layer comes in about once per pass (forward, then recompute and backward: 22 loads for 12
    # layers); looking 2 ahead through 2 slots used to evict every layer it had just fetched (542).
    assert store.ahead == 1 and store.stats.loads <= 2 * len(store.layers) + store.slots


def _three_layers(wide_last=True):
    torch.manual_seed(0)
    weights = [CompressedWeight(compress(torch.randn(64, 64).bfloat16() * 0.01, steps=16), name=f"w{i}")
               for i in range(3)]
    if wide_last:
        wide = (torch.randn(64, 64) * torch.logspace(-20, 20, 64)).bfloat16()
        weights[2] = CompressedWeight(compress(wide, steps=16), name="w2")
    expected = [w.dense() for w in weights]
    store = WeightOffload("cpu", ahead=0, slots=2)
    for weight in weights:
        store.add_layer([weight])
    return store, weights, expected


def test_a_failed_slot_allocation_leaves_the_ring_usable(monkeypatch):
    store, weights, expected = _three_layers()
    weights[0].dense(), weights[1].dense()  # both slots taken, sized for the narrow layers
    real_empty = torch.empty

    def no_memory(*size, **kw):
        if kw.get("dtype") == torch.uint8 and kw.get("device") is not None:
            raise torch.OutOfMemoryError("test: no memory for a slot")
        return real_empty(*size, **kw)

    monkeypatch.setattr(torch, "empty", no_memory)
    with pytest.raises(torch.OutOfMemoryError):
        weights[2].dense()  # evicts layer 0, then its slot must grow: the allocation fails
    monkeypatch.undo()
    for index in (2, 0, 1, 2):  # memory again: every layer loads and decodes as it was
        assert torch.equal(weights[index].dense(), expected[index]), index
    resident = [layer for layer in store.layers if layer.slot is not None]
    assert len(resident) == 2 and all(store._owner[layer.slot] is layer for layer in resident)


def test_sync_debug_names_a_slot_overwritten_behind_the_stores_back():
    store, weights, expected = _three_layers(wide_last=False)
    store.sync_debug = True
    assert torch.equal(weights[1].dense(), expected[1])
    weights[1].ct.tile_base[1] += 7  # what a copy or kernel racing on another stream did to the 8B's slot
    with pytest.raises(OffloadFaultError, match=r"fetch of layer 1 weight w1 \(slot \d\).*tile_base.*element 1"):
        weights[1].dense()


def test_sync_debug_is_off_unless_asked(monkeypatch):
    monkeypatch.delenv("NEUTRAIN_OFFLOAD_SYNC_DEBUG", raising=False)
    assert not WeightOffload("cpu").sync_debug
    monkeypatch.setenv("NEUTRAIN_OFFLOAD_SYNC_DEBUG", "1")
    assert WeightOffload("cpu").sync_debug
    monkeypatch.setenv("NEUTRAIN_OFFLOAD_SYNC_DEBUG", "0")
    assert not WeightOffload("cpu").sync_debug
