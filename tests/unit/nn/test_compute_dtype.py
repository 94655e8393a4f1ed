"""bf16 compressed storage under fp32 compute (the CPU setting) against fp32 twins holding the same values."""

import copy

import pytest
import torch

from neutrain.compress import compress
from neutrain.nn import CompressedEmbedding, CompressedLinear, CompressedWeight, causal_lm_loss, compress_model
from neutrain.nn import compressed_weights, decompressed_state_dict
from neutrain.optim import LOMO

from .nn_helpers import CODEC, GradCapture, tiny_config, token_batches


def _upcast_twin(weight_bf16):
    weight = CompressedWeight(compress(weight_bf16, **CODEC), compute_dtype=torch.float32)
    weight.optimizer = GradCapture()
    return weight


def test_linear_computes_in_fp32_on_the_upcast_weight():
    dense = torch.nn.Linear(24, 40)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(40, 24).bfloat16().float())  # fp32 holding bf16 values
    weight = _upcast_twin(dense.weight.detach().bfloat16())
    layer = CompressedLinear(weight, bias=torch.nn.Parameter(dense.bias.detach().clone()))
    assert weight.ct.dtype == torch.bfloat16 and weight.key.dtype == torch.float32
    x1 = torch.randn(3, 5, 24, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    g = torch.randn(3, 5, 40)
    y1, y2 = dense(x1), layer(x2)
    assert y2.dtype == torch.float32 and torch.equal(y1, y2)
    y1.backward(g)
    y2.backward(g)
    assert torch.equal(x1.grad, x2.grad)
    grad_w = weight.optimizer.grads[weight.key]
    assert grad_w.dtype == torch.float32 and torch.equal(dense.weight.grad, grad_w)


def test_embedding_rows_come_out_in_the_compute_dtype():
    table = torch.randn(50, 12).bfloat16()
    dense = torch.nn.Embedding(50, 12, padding_idx=3)
    with torch.no_grad():
        dense.weight.copy_(table.float())
    weight = _upcast_twin(table)
    emb = CompressedEmbedding(weight, padding_idx=3)
    ids = torch.tensor([[3, 7, 7, 49], [0, 3, 12, 7]])
    g = torch.randn(2, 4, 12)
    out1, out2 = dense(ids), emb(ids)
    assert out2.dtype == torch.float32 and torch.equal(out1, out2)
    out1.backward(g)
    out2.backward(g)
    assert torch.equal(dense.weight.grad, weight.optimizer.grads[weight.key])


def _fp32_twins(tie):
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_config(tiny_config(tie), dtype=torch.float32).train()
    compressed = copy.deepcopy(dense)
    report = compress_model(compressed, progress=False, codec_options=CODEC, storage_dtype=torch.bfloat16)
    with torch.no_grad():  # the dense twin holds exactly the stored bf16 values, in fp32
        for name, value in decompressed_state_dict(compressed).items():
            dense.get_parameter(name).copy_(value.float())
    return dense, compressed, report


@pytest.mark.slow
def test_model_gradients_match_an_fp32_twin_bit_for_bit():
    for tie in (False, True):
        dense, compressed, report = _fp32_twins(tie)
        assert report.weight_bytes_before == sum(w.numel * 2 for w in compressed_weights(compressed))
        assert compressed.dtype == torch.float32
        capture = GradCapture()
        for weight in compressed_weights(compressed):
            assert weight.ct.dtype == torch.bfloat16 and weight.compute_dtype == torch.float32
            weight.optimizer = capture
        ids = token_batches(1, seed=5)[0]
        loss_dense, loss_compressed = causal_lm_loss(dense, ids, ids), causal_lm_loss(compressed, ids, ids)
        assert torch.equal(loss_dense, loss_compressed)
        loss_dense.backward()
        loss_compressed.backward()
        for weight in compressed_weights(compressed):
            name = weight.name.removesuffix(".weight")
            assert torch.equal(dense.get_submodule(name).weight.grad, capture.grads[weight.key]), (tie, weight.name)
        assert torch.equal(dense.model.norm.weight.grad, compressed.model.norm.weight.grad)


@pytest.mark.slow
def test_fused_training_rounds_updates_back_to_bf16_storage():
    _, compressed, _ = _fp32_twins(tie=True)
    start = {w.name: w.dense() for w in compressed_weights(compressed)}
    opt = LOMO(compressed.parameters(), lr=0.1, seed=1).bind(compressed)
    losses = []
    for ids in token_batches(4, seed=2) * 2:
        loss = causal_lm_loss(compressed, ids, ids)
        opt.backward(loss)
        opt.step()
        losses.append(float(loss.detach()))
    assert sum(losses[4:]) < sum(losses[:4]), losses  # the same batches again, after an epoch of updates
    for weight in compressed_weights(compressed):
        now = weight.dense()
        assert now.dtype == torch.bfloat16 and torch.isfinite(now).all()
        assert (now != start[weight.name]).float().mean() > 0.5, weight.name


def test_bf16_stored_state_loads_into_a_model_built_in_fp32():
    # What loading a CPU run's checkpoint does: the skeleton is fp32, the saved blobs are bf16.
    from transformers import AutoModelForCausalLM

    _, compressed, _ = _fp32_twins(tie=False)
    torch.manual_seed(1)
    fresh = AutoModelForCausalLM.from_config(tiny_config(False), dtype=torch.float32).train()
    compress_model(fresh, progress=False, codec_options=CODEC)
    assert all(w.ct.dtype == torch.float32 for w in compressed_weights(fresh))
    fresh.load_state_dict(compressed.state_dict())
    assert all(w.ct.dtype == torch.bfloat16 and w.compute_dtype == torch.float32 for w in compressed_weights(fresh))
    ids = token_batches(1, seed=6)[0]
    with torch.no_grad():
        assert torch.equal(causal_lm_loss(fresh, ids, ids), causal_lm_loss(compressed, ids, ids))
    state = decompressed_state_dict(fresh)
    assert all(v.dtype == torch.float32 for v in state.values())
    assert torch.equal(state["lm_head.weight"], compressed.lm_head.compressed.dense().float())
