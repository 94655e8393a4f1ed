"""The sequence-chunked MLP computes the unchunked MLP's output and gradients (up to reduction order)."""

import copy

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from neutrain.nn import CompressedLinear, causal_lm_loss, compressed_weights
from neutrain.nn.chunked_mlp import chunk_mlps, chunkable

from .nn_helpers import dense_and_compressed, enable_checkpointing, tiny_llama, token_batches

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _mlp(seed, hidden, intermediate, dtype):
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=1,
                         num_key_value_heads=1, hidden_act="silu")
    return LlamaMLP(config).to(dtype)


def _run(module, x, dy):
    x = x.detach().clone().requires_grad_(True)
    y = module(x)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad.clone() for p in module.parameters()]


def _close(a, b, dtype):
    # Scaled by the reference's largest entry: a bf16 sum over tokens rounds once per chunk instead of once.
    scale = max(float(a.abs().max()), 1.0)
    torch.testing.assert_close(a.float() / scale, b.float() / scale, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("seed", range(6))
def test_chunked_mlp_matches_unchunked(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = 2 * int(torch.randint(2, 20, (1,), generator=g))  # RoPE's config check wants an even head size
    intermediate = int(torch.randint(4, 40, (1,), generator=g))
    batch, seq = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(2, 30, (1,), generator=g))
    chunk = int(torch.randint(1, batch * seq, (1,), generator=g))  # below the token count: chunked
    if (batch * seq) % chunk == 0 and chunk > 1:
        chunk -= 1  # a last chunk shorter than the others
    reference = _mlp(seed, hidden, intermediate, dtype)
    chunked = copy.deepcopy(reference)
    assert chunk_mlps(chunked, chunk) == 1
    x = torch.randn(batch, seq, hidden, generator=g).to(dtype)
    dy = torch.randn(batch, seq, hidden, generator=g).to(dtype)
    want, got = _run(reference, x, dy), _run(chunked, x, dy)
    for name, a, b in zip(["output", "input grad", "gate grad", "up grad", "down grad"], want, got):
        assert a.shape == b.shape, name
        _close(a, b, dtype)


def test_short_inputs_run_unchunked_and_zero_restores_the_forward():
    mlp = _mlp(0, 8, 12, torch.float32)
    original = mlp.forward
    chunk_mlps(mlp, 16)
    x = torch.randn(2, 8, 8)
    assert torch.equal(mlp(x), original(x))  # 16 tokens: one chunk, the module's own forward
    chunk_mlps(mlp, 0)
    assert mlp.forward == original


def test_adapters_and_biases_are_left_alone():
    mlp = _mlp(0, 8, 12, torch.float32)
    mlp.up_proj = torch.nn.Linear(8, 12, bias=True)
    assert not chunkable(mlp)
    assert chunk_mlps(mlp, 2) == 0


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_chunked_decoder_matches_unchunked_whole_model(checkpointing):
    reference = tiny_llama(seed=1).float()
    chunked = copy.deepcopy(reference)
    assert chunk_mlps(chunked, 5) == 2
    if checkpointing:
        enable_checkpointing(reference)
        enable_checkpointing(chunked)
    (ids,) = token_batches(1, seed=2, batch=2, length=11)  # 22 tokens: chunks of 5, 5, 5, 5, 2
    for model in (reference, chunked):
        causal_lm_loss(model, ids, ids).backward()
    for (name, a), (_, b) in zip(reference.named_parameters(), chunked.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


class _CountingCapture:
    """Stands in for a fused optimizer: the gradients handed to it and how many times each weight got one."""

    def __init__(self):
        self.grads, self.calls = {}, {}

    def consume_grad_(self, key, grad, io):
        self.grads[key] = grad.clone()
        self.calls[key] = self.calls.get(key, 0) + 1


def _backward_into(capture, model, ids, chunk):
    """One backward of ``model`` (MLPs in chunks of ``chunk``) whose NeuZip weights hand their gradients to
    ``capture``; returns the weights' names by key."""
    for weight in compressed_weights(model):
        weight.optimizer = capture
    chunk_mlps(model, chunk)
    causal_lm_loss(model, ids, ids).backward()
    return {w.key: w.name for w in compressed_weights(model)}


def _captured_grads(model, ids, chunk):
    capture = _CountingCapture()
    names = _backward_into(capture, model, ids, chunk)
    return {names[k]: g for k, g in capture.grads.items()}, {names[k]: c for k, c in capture.calls.items()}


@pytest.fixture(params=["kept", "shared_slots"])
def decode_buffers(request):
    """Decodes in buffers of their own (the CPU default), or only in the shared slots (the GPU default: no
    decode is kept, so the chunked MLP's three weights share the alternating slots and the held one)."""
    from neutrain.nn.buffers import DECODE_BUFFERS

    cpu = torch.device("cpu")
    saved = DECODE_BUFFERS.keep_bytes.get(cpu)
    DECODE_BUFFERS.clear()
    if request.param == "shared_slots":
        DECODE_BUFFERS.keep_bytes[cpu] = 0
    yield request.param
    DECODE_BUFFERS.clear()
    DECODE_BUFFERS.keep_bytes.pop(cpu, None)
    if saved is not None:
        DECODE_BUFFERS.keep_bytes[cpu] = saved


def test_compressed_chunked_forward_reads_each_matrix_its_own_weight(decode_buffers):
    """Gate, up and down are decoded before the first chunk and read by every chunk: with only the shared
    slots, the third decode must not land in the first one's slot."""
    _, compressed = dense_and_compressed(layers=2)
    (ids,) = token_batches(1, seed=3, batch=2, length=12)
    with torch.no_grad():
        want = compressed(ids).logits.float()
        chunk_mlps(compressed, 7)
        got = compressed(ids).logits.float()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3 * float(want.abs().max()))


def test_compressed_weights_get_one_whole_gradient_per_step(decode_buffers):
    _, compressed = dense_and_compressed(layers=2)
    twin = copy.deepcopy(compressed)
    enable_checkpointing(compressed)
    enable_checkpointing(twin)
    assert isinstance(compressed.model.layers[0].mlp.gate_proj, CompressedLinear)
    (ids,) = token_batches(1, seed=3, batch=2, length=12)
    want, _ = _captured_grads(twin, ids, 0)
    got, calls = _captured_grads(compressed, ids, 7)  # 24 tokens: chunks of 7, 7, 7, 3
    assert want.keys() == got.keys()
    assert set(calls.values()) == {1}  # one update per matrix, not one per chunk
    for name in want:
        _close(want[name], got[name], torch.bfloat16)


def test_the_recompute_stops_before_the_chunked_mlp(monkeypatch):
    """The checkpoint's recompute ends at the MLP's saved input: the chunks' products run once in forward and
    once (gate and up) in the MLP's own backward, never a third time in the recompute."""
    import neutrain.nn.chunked_mlp as chunked_mlp

    calls = []
    forward_rows = chunked_mlp._forward_rows
    monkeypatch.setattr(chunked_mlp, "_forward_rows", lambda *args: (calls.append(1), forward_rows(*args))[1])
    model = tiny_llama(seed=1).float()
    enable_checkpointing(model)
    chunk_mlps(model, 5)
    (ids,) = token_batches(1, seed=2, batch=2, length=11)
    loss = causal_lm_loss(model, ids, ids)
    assert len(calls) == 2  # one per decoder layer
    loss.backward()
    assert len(calls) == 2


class _UpdatingCapture(_CountingCapture):
    """A fused optimizer that really writes: records each gradient and the order they came in, then takes a large
    step (``w -= grad``), so that a later product that read an updated weight would change a later gradient."""

    def __init__(self):
        super().__init__()
        self.order = []

    def consume_grad_(self, key, grad, io):
        super().consume_grad_(key, grad, io)
        self.order.append(key)
        weight = io.read()
        weight.sub_(grad.to(weight.dtype))
        io.write_(weight)


def _updated_grads(model, ids, chunk):
    capture = _UpdatingCapture()
    names = _backward_into(capture, model, ids, chunk)
    return {names[k]: g for k, g in capture.grads.items()}, [names[k] for k in capture.order]


def test_down_is_updated_first_and_every_gradient_keeps_its_one_pass_bits(decode_buffers, monkeypatch):
    """On the shared slots (the GPU's case) down's gradient goes to its update before gate's and up's exist, so at
    most two weight gradients are alive at once. The second pass must still read down's weight as decoded before
    its update: each gradient has the bits the one-pass backward gives it, though every update here is large."""
    import neutrain.nn.chunked_mlp as chunked_mlp

    _, compressed = dense_and_compressed(layers=2)
    twin = copy.deepcopy(compressed)
    enable_checkpointing(compressed)
    enable_checkpointing(twin)
    (ids,) = token_batches(1, seed=4, batch=2, length=12)
    got, order = _updated_grads(compressed, ids, 5)  # 24 tokens: chunks of 5, 5, 5, 5, 4
    monkeypatch.setattr(chunked_mlp, "two_pass", lambda down: False)
    want, one_pass_order = _updated_grads(twin, ids, 5)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    for layer in range(2):
        mlp = [n for n in order if f"layers.{layer}.mlp." in n]
        if decode_buffers == "shared_slots":
            assert mlp == [f"model.layers.{layer}.mlp.{p}_proj.weight" for p in ("down", "gate", "up")]
        else:  # a kept decode is the buffer the update writes into: one pass, as before
            assert mlp == [n for n in one_pass_order if f"layers.{layer}.mlp." in n]
