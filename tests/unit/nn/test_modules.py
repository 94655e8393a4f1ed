"""CompressedLinear, CompressedEmbedding and the chunked lm_head loss against their dense twins."""

import pytest
import torch

from neutrain.compress import compress
from neutrain.nn import CompressedEmbedding, CompressedLinear, CompressedWeight, causal_lm_loss, linear_cross_entropy

from .nn_helpers import CODEC, GradCapture, tiny_llama, token_batches


def _compressed_twin(dense_weight):
    weight = CompressedWeight(compress(dense_weight.detach(), **CODEC))
    capture = GradCapture()
    weight.optimizer = capture
    return weight, capture


def test_linear_with_bias_matches_nn_linear_bitwise():
    dense = torch.nn.Linear(24, 40).bfloat16()
    weight, capture = _compressed_twin(dense.weight)
    layer = CompressedLinear(weight, bias=torch.nn.Parameter(dense.bias.detach().clone()))
    x1 = torch.randn(3, 5, 24, dtype=torch.bfloat16, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    g = torch.randn(3, 5, 40, dtype=torch.bfloat16)
    y1, y2 = dense(x1), layer(x2)
    assert torch.equal(y1, y2)
    y1.backward(g)
    y2.backward(g)
    assert torch.equal(x1.grad, x2.grad)
    assert torch.equal(dense.bias.grad, layer.bias.grad)
    assert torch.equal(dense.weight.grad, capture.grads[weight.key])
    assert weight.key.grad is None


def test_embedding_matches_nn_embedding_with_padding():
    dense = torch.nn.Embedding(50, 12, padding_idx=3).bfloat16()
    weight, capture = _compressed_twin(dense.weight)
    emb = CompressedEmbedding(weight, padding_idx=3)
    ids = torch.tensor([[3, 7, 7, 49], [0, 3, 12, 7]])
    g = torch.randn(2, 4, 12, dtype=torch.bfloat16)
    out1, out2 = dense(ids), emb(ids)
    assert torch.equal(out1, out2)
    out1.backward(g)
    out2.backward(g)
    assert torch.equal(dense.weight.grad, capture.grads[weight.key])
    assert not capture.grads[weight.key][3].any()


def test_frozen_weight_needs_no_optimizer_and_unbound_trainable_weight_raises():
    dense = torch.nn.Linear(8, 8, bias=False).bfloat16()
    frozen = CompressedLinear(CompressedWeight(compress(dense.weight.detach(), **CODEC), requires_grad=False))
    x = torch.randn(2, 8, dtype=torch.bfloat16, requires_grad=True)
    frozen(x).sum().backward()
    dense.requires_grad_(False)
    y = x.detach().clone().requires_grad_()
    dense(y).sum().backward()
    assert torch.equal(x.grad, y.grad)
    trainable = CompressedLinear(CompressedWeight(compress(dense.weight.detach(), **CODEC)))
    with pytest.raises(RuntimeError, match="no fused optimizer is bound"):
        trainable(torch.randn(2, 8, dtype=torch.bfloat16)).sum().backward()


@pytest.mark.parametrize("chunk_bytes", [1 << 30, 9 * 4 * 7])  # one chunk; chunks of 7 columns
def test_linear_cross_entropy_matches_full_logits(chunk_bytes):
    head = torch.nn.Linear(16, 45, bias=False)
    hidden = torch.randn(9, 16, requires_grad=True)
    labels = torch.randint(0, 45, (9,))
    labels[[2, 5]] = -100
    ref_hidden = hidden.detach().clone().requires_grad_()
    ref_head = torch.nn.Linear(16, 45, bias=False)
    ref_head.weight.data.copy_(head.weight.data)
    ref = torch.nn.functional.cross_entropy(ref_head(ref_hidden), labels)
    loss = linear_cross_entropy(hidden, head, labels, chunk_bytes=chunk_bytes)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    (loss * 3).backward()
    (ref * 3).backward()
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.weight.grad, ref_head.weight.grad, rtol=1e-5, atol=1e-6)
    total = linear_cross_entropy(hidden, head, labels, num_items_in_batch=14, chunk_bytes=chunk_bytes)
    torch.testing.assert_close(total, ref * 7 / 14, rtol=1e-6, atol=1e-6)


def test_causal_lm_loss_matches_transformers_loss():
    model = tiny_llama().float()
    ids = token_batches(1)[0]
    labels = ids.clone()
    labels[0, :4] = -100
    expected = model(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(causal_lm_loss(model, ids, labels), expected, rtol=1e-5, atol=1e-5)
