"""Decoder layers compiled for the one-token decode step (``DecodeEngine(compile_layers=True)``): the same greedy
tokens and logits as the eager layers, only one-token calls compiled, the model left as it was, a fused group
whose weights moved falls back to the eager layers. CPU tests in fp32; the ``gpu`` test replays the compiled step
in a CUDA graph."""

import copy

import pytest
import torch
from torch import nn

from neutrain.decode.compiled_layers import CompiledLayers, decoder_layers
from neutrain.decode.engine import DecodeEngine
from tests.unit.decode.test_fused_projections import PROMPT, _decode_logits, tiny


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles anew, and leaves no compiled state (nor the fake tensors it traced with) to later tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled_calls(layers: CompiledLayers) -> list[int]:
    """Counters of how often each layer's compiled forward ran (wrapping the compiled callables)."""
    counts = [0] * len(layers.compiled)

    def counted(i, fn):
        def call(*args, **kwargs):
            counts[i] += 1
            return fn(*args, **kwargs)
        return call

    layers.compiled = [counted(i, fn) for i, fn in enumerate(layers.compiled)]
    return counts


def test_the_compiled_step_decodes_the_eager_engines_tokens_and_logits():
    eager_model = tiny(3, layers=3).requires_grad_(False)  # frozen: the engine fuses Q/K/V and gate/up
    model = copy.deepcopy(eager_model)
    want_tokens, want = _decode_logits(DecodeEngine(eager_model, max_len=64), PROMPT, 12)
    engine = DecodeEngine(model, max_len=64, compile_layers=True)
    assert engine.fused_groups == 6
    counts = _compiled_calls(engine.compiled_layers)
    tokens, got = _decode_logits(engine, PROMPT, 12)
    assert tokens == want_tokens
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # the prefill (7 tokens) ran the eager layers, each of the 12 steps the compiled ones
    assert counts == [12, 12, 12]
    # outside the engine's calls the model is as it was: no layer keeps the compiled forward
    assert all("forward" not in layer.__dict__ for layer in decoder_layers(model))


def test_a_group_whose_weights_moved_runs_the_eager_layers_and_stays_correct():
    model = tiny(4, layers=2).requires_grad_(False)
    engine = DecodeEngine(model, max_len=64, compile_layers=True)
    assert engine.fused_groups == 4 and engine.compiled_layers.usable(1)
    counts = _compiled_calls(engine.compiled_layers)
    # re-allocating a member's weight breaks its group's fused matrix (as model.to(dtype) would)
    proj = model.model.layers[1].self_attn.k_proj
    proj.weight.data = proj.weight.data.clone()
    assert not engine.compiled_layers.usable(1)
    reference = copy.deepcopy(model)
    tokens, got = _decode_logits(engine, PROMPT, 5)
    want_tokens, want = _decode_logits(DecodeEngine(reference, max_len=64, fuse=False), PROMPT, 5)
    assert counts == [0, 0] and tokens == want_tokens
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_more_rows_than_the_limit_run_eager():
    layers = CompiledLayers(tiny(5, layers=2), max_rows=1)
    with layers.active(2) as used:
        assert used is False
    with layers.active(1) as used:
        assert used is True and all("forward" in layer.__dict__ for layer in layers.layers)
    assert all("forward" not in layer.__dict__ for layer in layers.layers)


def test_a_model_without_decoder_layers_is_refused_naming_it():
    with pytest.raises(ValueError, match="Sequential has none"):
        CompiledLayers(nn.Sequential(nn.Linear(2, 2)))


@pytest.mark.gpu
def test_the_compiled_step_replayed_in_a_cuda_graph_decodes_the_eager_engines_tokens():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.backends.cuda.matmul.allow_tf32 = False
    eager_model = tiny(6, layers=4, device="cuda").requires_grad_(False)
    model = copy.deepcopy(eager_model)
    prompt = PROMPT.cuda()
    want_tokens, want = _decode_logits(DecodeEngine(eager_model, max_len=96), prompt, 40)
    engine = DecodeEngine(model, max_len=96, compile_layers=True)
    tokens, got = _decode_logits(engine, prompt, 40)
    assert engine.use_graph and tokens == want_tokens  # fp32: greedy identical
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
