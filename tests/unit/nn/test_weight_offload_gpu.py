"""Weight offload on CUDA: real copy streams, pinned host arenas; training bit for bit as without offload."""

import pytest
import torch

from neutrain.nn import causal_lm_loss, compress_model
from neutrain.nn.weight_offload import PAYLOAD
from neutrain.nn.weight_offload_model import offload_weights
from neutrain.optim import LOMO, AdaLomo

from .nn_helpers import enable_checkpointing, tiny_llama, token_batches

pytestmark = pytest.mark.gpu


def _model(offload, slots=3):
    model = tiny_llama(seed=4, hidden=256, layers=5).cuda()
    compress_model(model, progress=False)
    enable_checkpointing(model)
    return model, (offload_weights(model, ahead=1, slots=slots) if offload else None)


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
