"""Layer groups on the GPU: the grouped decode and encode kernels in training, bit for bit dense training."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from neutrain.kernels.codec_common import COUNTERS
from neutrain.nn import compress_model, compressed_weights
from neutrain.nn.groups import LAYER_GROUPS
from neutrain.optim import LOMO, AdaLomo

from .nn_helpers import enable_checkpointing, token_batches, train, weights

pytestmark = pytest.mark.gpu


def _llama(hidden=256, layers=3, vocab=512):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, vocab_size=vocab)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().train()


@pytest.mark.parametrize("rule", ["lomo", "adalomo"])
def test_gpu_grouped_training_matches_dense_bit_for_bit(rule, monkeypatch):
    monkeypatch.setenv("NEUTRAIN_LAYER_GROUPS", "1")  # these small layers would not be grouped by default
    dense = _llama()
    compressed = copy.deepcopy(dense)
    compress_model(compressed, progress=False)
    assert all(w.group is not None for w in compressed_weights(compressed.model.layers[0]))
    enable_checkpointing(dense)
    enable_checkpointing(compressed)
    make = (lambda p: LOMO(p, lr=5e-2, seed=2)) if rule == "lomo" else \
        (lambda p: AdaLomo(p, lr=2e-2, clip_mode="per_tensor", max_grad_norm=1.0, seed=2))
    data = [ids.cuda() for ids in token_batches(4, batch=2, length=64)]
    start = weights(dense)
    norms_dense = train(dense, make(dense.parameters()), data)
    decodes, encodes, kernels = LAYER_GROUPS.decodes, LAYER_GROUPS.encodes, COUNTERS["decode"]
    norms_compressed = train(compressed, make(compressed.parameters()), data)
    torch.cuda.synchronize()
    assert norms_dense == norms_compressed
    a, b = weights(dense), weights(compressed)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert sum(int((a[n] != start[n]).sum()) for n in a) >= sum(v.numel() for v in a.values()) / 2
    # The grouped kernels ran: two grouped decodes per layer and step (forward, recompute), one encode.
    assert LAYER_GROUPS.decodes - decodes == 2 * 3 * len(data)
    assert LAYER_GROUPS.encodes - encodes == 3 * len(data)
    assert COUNTERS["decode"] > kernels
    for w in compressed_weights(compressed):
        w.ct.status.poll(wait=True)  # no update was lost to a stream overflow
        assert not w.ct.status.tensor[2].item(), w.name


def test_gpu_groups_form_by_default_for_llama3_8b_shaped_layers(monkeypatch):
    """Two Llama-3-8B layers and its vocabulary: under expandable segments the layers are grouped by default."""
    from neutrain.nn.buffers import expandable_segments

    monkeypatch.delenv("NEUTRAIN_LAYER_GROUPS", raising=False)
    if not expandable_segments():
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # read by the rule, not torch
    from neutrain.nn.load import init_compressed

    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                      num_attention_heads=32, num_key_value_heads=8)
    model, _ = init_compressed(cfg, "neuzip-lossless", "cuda", progress=False)
    layer_weights = compressed_weights(model.model.layers[1])
    assert len(layer_weights) == 7 and all(w.group is layer_weights[0].group for w in layer_weights)
    for w in layer_weights:
        assert torch.equal(w.decode().view(torch.int16), w.ct.decompress().view(torch.int16)), w.name
    del model
    LAYER_GROUPS.release()
    torch.cuda.empty_cache()
