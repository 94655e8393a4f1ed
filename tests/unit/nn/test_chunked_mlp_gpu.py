"""GPU: the sequence-chunked MLP matches the unchunked one in a checkpointed decoder layer, dense and NeuZip,
and its backward's peak memory is a chunk's, not the sequence's."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from neutrain.nn import causal_lm_loss, compress_model, compressed_weights
from neutrain.nn.chunked_mlp import chunk_mlps

pytestmark = pytest.mark.gpu

HIDDEN, INTERMEDIATE, TOKENS, CHUNK = 1024, 8192, 8192, 1024


def _model(layers=2):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, vocab_size=512, max_position_embeddings=TOKENS)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _peak_backward(model, ids):
    loss = causal_lm_loss(model, ids, ids)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_chunked_mlp_matches_unchunked_and_its_backward_peak_drops():
    reference = _model()
    chunked = copy.deepcopy(reference)
    assert chunk_mlps(chunked, CHUNK) == 2
    ids = torch.randint(0, 512, (1, TOKENS), device="cuda")
    whole = _peak_backward(reference, ids)
    part = _peak_backward(chunked, ids)
    for (name, a), (_, b) in zip(reference.named_parameters(), chunked.named_parameters()):
        scale = max(float(a.grad.abs().max()), 1e-6)
        torch.testing.assert_close(a.grad.float() / scale, b.grad.float() / scale, rtol=2e-2, atol=2e-2, msg=name)
    # Unchunked, the layer's backward holds six tokens x intermediate bf16 blocks (768 MiB here); chunked, six
    # of a chunk's and the three MLP weight gradients at once (48 MiB).
    block = TOKENS * INTERMEDIATE * 2
    assert part < whole - 3 * block, (part / 2**20, whole / 2**20)


def test_compressed_chunked_layer_trains_as_the_unchunked_one():
    from neutrain.optim import LOMO

    # Two builds from one seed, each compressed: a compressed model's hooks do not deepcopy on CUDA
    # (torch's RemovableHandle holds a weak reference to a dict that is gone).
    reference, chunked = _model(), _model()
    for model in (reference, chunked):
        compress_model(model, progress=False)
    chunk_mlps(chunked, CHUNK)
    ids = torch.randint(0, 512, (1, TOKENS), device="cuda")
    for model in (reference, chunked):
        opt = LOMO(model.parameters(), lr=1e-3, stochastic_rounding=False)
        opt.bind(model)
        opt.backward(causal_lm_loss(model, ids, ids))
        opt.step()
    for a, b in zip(compressed_weights(reference), compressed_weights(chunked)):
        assert a.version == b.version == 1, a.name  # one update a step, chunked or not
        da, db = a.dense().float(), b.dense().float()
        torch.testing.assert_close(da, db, rtol=2e-2, atol=2e-3, msg=a.name)


def test_two_pass_backward_holds_one_weight_gradient_less_and_trains_the_same_bits(monkeypatch):
    """NeuZip weights in the shared slots (the GPU's case): down's gradient goes to its update before gate's and
    up's exist, so the backward's peak drops by about one MLP matrix against the one-pass backward, and the
    weights after the step are the one-pass backward's, bit for bit (the second pass reads down's old values)."""
    import neutrain.nn.chunked_mlp as chunked_mlp
    from neutrain.optim import LOMO

    models = {}
    peaks = {}
    for mode in ("one_pass", "two_pass"):
        if mode == "one_pass":
            monkeypatch.setattr(chunked_mlp, "two_pass", lambda down: False)
        else:
            monkeypatch.undo()
        model = _model()
        compress_model(model, progress=False)
        chunk_mlps(model, CHUNK)
        ids = torch.randint(0, 512, (1, TOKENS), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        opt = LOMO(model.parameters(), lr=1e-3, stochastic_rounding=False)
        opt.bind(model)
        loss = causal_lm_loss(model, ids, ids)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        opt.backward(loss)
        opt.step()
        torch.cuda.synchronize()
        peaks[mode] = torch.cuda.max_memory_allocated() - base
        models[mode] = model
    matrix = HIDDEN * INTERMEDIATE * 2
    assert peaks["two_pass"] <= peaks["one_pass"] - 0.75 * matrix, (peaks["one_pass"] / 2**20, peaks["two_pass"] / 2**20)
    # The last layer's MLP: its gradients come from the forward and the loss alone, so they are reproducible (the
    # attention's and the embedding's backward on CUDA are not: what flows into the earlier layers may differ).
    last = f"model.layers.{len(models['one_pass'].model.layers) - 1}.mlp."
    compared = 0
    for a, b in zip(compressed_weights(models["one_pass"]), compressed_weights(models["two_pass"])):
        assert a.version == b.version == 1, a.name
        if a.name.startswith(last):
            assert torch.equal(a.dense(), b.dense()), a.name
            compared += 1
    assert compared == 3
