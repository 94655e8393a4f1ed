"""Weight offload on CUDA: real copy streams, pinned host arenas; training bit for bit as without offload."""

import pytest
import torch

from neutrain.nn import causal_lm_loss, compress_model
from neutrain.nn.weight_offload import PAYLOAD
from neutrain.nn.weight_offload_model import offload_weights
from neutrain.optim import LOMO, AdaLomo

from .nn_helpers import enable_checkpointing, tiny_llama, token_batches

pytestmark = pytest.mark.gpu


def _model(offload, slots=3, count=None):
    """The 5-layer model, compressed and checkpointed; with ``offload``, its store (``count`` layers of it:
    :meth:`LayerPlacement.spread`, with the spread ring's own slots: ``slots`` is the whole model's ring)."""
    model = tiny_llama(seed=4, hidden=256, layers=5).cuda()
    compress_model(model, progress=False)
    enable_checkpointing(model)
    ring = slots if count is None else None  # a given count of slots would replace the spread ring's
    return model, (offload_weights(model, ahead=1, slots=ring, count=count) if offload else None)


def _train(model, rule, data):
    kwargs = {"lr": 0.02, "stochastic_rounding": False}
    opt = (LOMO(model.parameters(), clip_mode="per_tensor", max_grad_norm=1.0, **kwargs) if rule == "lomo"
           else AdaLomo(model.parameters(), **kwargs)).bind(model)
    for ids in data:
        opt.backward(causal_lm_loss(model, ids.cuda(), ids.cuda()))
        opt.step()
    torch.cuda.synchronize()
    return {k: v.cpu() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("rule", ["lomo", "adalomo"])
def test_offloaded_training_on_cuda_is_bit_identical(rule):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; run on the device machine")
    data = token_batches(4, seed=6, batch=2, length=64)
    plain, _ = _model(False)
    expected = _train(plain, rule, data)
    model, store = _model(True)
    got = _train(model, rule, data)
    assert store.stats.loads > len(store.layers) and store.stats.writebacks == 4 * 7 * len(store.layers)
    assert len(store._registered) == len(store.layers) and store.pinned_bytes >= store.host_bytes
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    # Between uses the layers hold no payload on the device beyond the slots.
    resident = [layer for layer in store.layers if layer.slot is not None]
    assert len(resident) <= store.slots
    idle = [w for layer in store.layers if layer.slot is None for w in layer.weights]
    assert idle and all(getattr(w.ct, n).numel() == 0 for w in idle for n in PAYLOAD)
    store.close()


@pytest.mark.parametrize("rule", ["lomo", "adalomo"])
def test_some_layers_offloaded_on_cuda_train_bit_identically_to_none(rule):
    # memory.offload_layers: 2 of 5 layers (1 and 3) through the spread ring (2 slots, 1 ahead), the
    # others resident and prefetched by the decode buffers as without offload.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; run on the device machine")
    data = token_batches(4, seed=6, batch=2, length=64)
    plain, _ = _model(False)
    expected = _train(plain, rule, data)
    model, store = _model(True, count=2)
    got = _train(model, rule, data)
    assert (len(store.layers), store.slots) == (2, 2) and store.stats.writebacks == 4 * 7 * 2
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    store.close()


def test_a_new_slot_waits_for_compute_work_queued_before_it():
    """The 8B's fault: a slot allocated on the compute stream got a block that queued compute kernels
    still wrote, while the copy into it ran at once on the copy stream. Here such a kernel is held back
    (``_sleep``) so the race goes the wrong way every time: without the copy stream waiting, the kernel
    zeroes the payload after the copy and the decode returns garbage."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; run on the device machine")
    from neutrain.compress import compress
    from neutrain.nn import CompressedWeight
    from neutrain.nn.weight_offload import WeightOffload, slot_bytes, slot_layout

    torch.manual_seed(0)
    # 2048 x 2048: a multi-MiB slot, from the allocator's large pool (best fit: the freed block is reused).
    weights = [CompressedWeight(compress(torch.randn(2048, 2048, device="cuda").bfloat16()), name=f"w{i}")
               for i in range(2)]
    expected = [w.dense() for w in weights]
    store = WeightOffload("cuda", ahead=0, slots=2)
    for weight in weights:
        store.add_layer([weight])
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no other free block: the slot's request can only get the one freed below
    block = torch.empty(slot_bytes(slot_layout(store.layers[0].weights)[1]), dtype=torch.uint8, device="cuda")
    address = block.data_ptr()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of compute-stream work queued ...
    block.zero_()  # ... then a kernel that writes the block ...
    del block  # ... which the allocator hands to the next request on this stream at once
    got = weights[0].dense()  # fetch: a new slot, then the copy in, then the decode
    assert store._buffers[0].data_ptr() == address, "premise: the slot reused the freed block"
    assert torch.equal(got, expected[0])
    store.close()


@pytest.mark.parametrize(("slots", "ahead", "debug"), [(2, 1, False), (4, 2, False), (2, 1, True)],
                         ids=["2-slots", "4-slots", "2-slots-sync-debug"])
def test_many_layers_few_slots_with_activation_offload_on_cuda_are_bit_identical(slots, ahead, debug):
    """12 layers of unequal payloads through 2-4 slots, checkpointing with the saved inputs in host
    memory, LOMO, 3 steps (the 8B's configuration, scaled down): as without weight offload, bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; run on the device machine")
    from .test_weight_offload_ring import assert_same, train_steps, unequal_llama

    data = token_batches(3, seed=8, batch=2, length=64)  # one attention block: a deterministic backward
    expected = train_steps(unequal_llama(hidden=256, device="cuda", codec={}), data, "cuda")
    model = unequal_llama(hidden=256, device="cuda", codec={})
    store = offload_weights(model, ahead=ahead, slots=slots)
    store.sync_debug = debug
    got = train_steps(model, data, "cuda")
    torch.cuda.synchronize()
    assert store.stats.writebacks == 3 * 7 * len(store.layers) and store.stats.regrows >= 1
    assert_same(expected, got)
    store.close()
