"""Decode-ahead in the recorded order: the record is the real call order, a prefetch is never stale."""

import pytest
import torch

import neutrain.nn.prefetch as prefetch_module
from neutrain.compress import compress
from neutrain.nn import DECODE_BUFFERS, PREFETCHER, CompressedLinear, CompressedWeight
from neutrain.optim import LOMO

from .nn_helpers import CODEC, dense_and_compressed, enable_checkpointing, token_batches, train, weights


@pytest.fixture
def prefetcher(monkeypatch):
    """The process-wide prefetcher, on, decoding ahead on CPU, with no kept decodes (the shared slots)."""
    monkeypatch.setitem(DECODE_BUFFERS.keep_bytes, torch.device("cpu"), 0)
    monkeypatch.setattr(PREFETCHER, "enabled", True)
    monkeypatch.setattr(PREFETCHER, "eager_cpu", True)
    PREFETCHER.reset()
    yield PREFETCHER
    PREFETCHER.reset()


def _linear_names(model):
    """Compressed linear layers by weight, in module order (a Llama's forward order)."""
    return {m.compressed: name for name, m in model.named_modules()
            if isinstance(m, CompressedLinear) and not m.compressed.large}


@pytest.mark.slow
def test_recorded_order_is_forward_then_per_layer_recompute_and_backward(prefetcher):
    dense, compressed = dense_and_compressed()
    enable_checkpointing(compressed)
    names = _linear_names(compressed)
    order = list(names.values())
    mismatches = prefetcher.mismatches
    train(compressed, LOMO(compressed.parameters(), lr=0.1), token_batches(2))
    plan = [names[w] for w in prefetcher.plan]  # the first step's cycle, complete once step 2 began
    n = len(order)
    assert plan[:n] == order  # forward
    layers = sorted({name.split(".self_attn")[0].split(".mlp")[0] for name in order}, reverse=True)
    rest = plan[n:]
    # The recompute stops before each layer's last projection (down_proj), as dense's does: nothing its
    # backward needs comes after the product's input, saved ahead of the product (neutrain.nn.linear).
    assert len(rest) == 2 * n - len(layers)
    at = 0
    for layer in layers:  # backward: each layer recomputed (forward order) but its last product, then its backward
        mine = [name for name in order if name.startswith(layer + ".")]
        recompute, backward = rest[at:at + len(mine) - 1], rest[at + len(mine) - 1:at + 2 * len(mine) - 1]
        at += 2 * len(mine) - 1
        assert recompute == mine[:-1] and sorted(backward) == sorted(mine), (layer, recompute, backward)
    assert backward[-1] == order[0]  # the backward of the first layer's first projection comes last
    assert prefetcher.recording == prefetcher.plan  # step 2's cycle, in the same order
    assert prefetcher.mismatches == mismatches


@pytest.mark.slow
def test_prefetch_in_recorded_order_is_always_used_and_training_stays_bit_identical(prefetcher):
    dense, compressed = dense_and_compressed()
    enable_checkpointing(compressed)
    enable_checkpointing(dense)
    start = weights(dense)
    data = token_batches(3, seed=5)
    train(dense, LOMO(dense.parameters(), lr=0.1, stochastic_rounding=False), data)
    hits, launched, mismatches = DECODE_BUFFERS.prefetch_hits, prefetcher.launched, prefetcher.mismatches
    train(compressed, LOMO(compressed.parameters(), lr=0.1, stochastic_rounding=False), data)
    launched = prefetcher.launched - launched
    # Steps 2 and 3 follow step 1's record: every decode ahead is the weight asked for next.
    assert launched > 0 and DECODE_BUFFERS.prefetch_hits - hits == launched and prefetcher.mismatches == mismatches
    a, b = weights(dense), weights(compressed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert sum(int((a[k] != start[k]).sum()) for k in a) > 0


def _cycle(prefetcher, flag, requests):
    """Requests as CompressedLinear makes them; in backward the fused update re-encodes the weight."""
    for weight, backward in requests:
        flag[0] = backward
        out = weight.decode()
        prefetcher.after_decode(weight)
        if backward:
            out = out.clone()
            weight.write_(out)
    return out


def test_a_prefetch_never_serves_a_stale_version_and_a_mismatch_decodes_synchronously(prefetcher, monkeypatch):
    flag = [False]
    monkeypatch.setattr(prefetch_module, "in_backward", lambda: flag[0])
    a, b, c = (CompressedWeight(compress(torch.randn(8, 4).bfloat16(), **CODEC), name=n) for n in "abc")
    step = [(a, False), (b, False), (c, False), (c, True), (b, True), (a, True)]
    launched, mismatches = prefetcher.launched, prefetcher.mismatches
    _cycle(prefetcher, flag, step)
    assert prefetcher.launched == launched and prefetcher.plan == []
    _cycle(prefetcher, flag, step[:1])  # the next forward: the record becomes the plan; b decoded ahead
    assert prefetcher.plan == [a, b, c, c, b, a] and prefetcher.launched == launched + 1 and DECODE_BUFFERS.holds(b)
    new = torch.randn(8, 4).bfloat16()
    b.write_(new)  # re-encoded after its prefetch: the prefetched bytes are the old version
    assert not DECODE_BUFFERS.holds(b)
    decodes = b.decodes
    assert torch.equal(_cycle(prefetcher, flag, [(b, False)]), new) and b.decodes == decodes + 1
    _cycle(prefetcher, flag, step[2:])  # the rest of the cycle, as planned
    assert prefetcher.mismatches == mismatches
    # A cycle that departs from the plan: no more decodes ahead, and each request gets its own weight.
    launched = prefetcher.launched
    for request in [(a, False), (c, False), (b, False), (b, True), (c, True), (a, True)]:
        assert torch.equal(_cycle(prefetcher, flag, [request]), request[0].dense())
    assert prefetcher.mismatches == mismatches + 1 and prefetcher.launched == launched + 1  # only after the matching `a`


def test_forwards_without_grad_are_not_recorded(prefetcher):
    dense, compressed = dense_and_compressed()
    with torch.no_grad():
        compressed(torch.zeros(1, 4, dtype=torch.long))
    assert prefetcher.recording == [] and prefetcher.plan == []
    compressed(torch.zeros(1, 4, dtype=torch.long))
    layers = [m.compressed for m in compressed.modules() if isinstance(m, CompressedLinear)]
    assert prefetcher.recording == layers  # the lm_head too: its forward here is the module's
