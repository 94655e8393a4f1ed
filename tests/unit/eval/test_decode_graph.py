"""The decode step as a CUDA graph (neutrain/eval/kv/decode_graph.py): what cannot be replayed is refused with its
reason, the host counts a replay leaves are those eager steps leave, and on a GPU the replayed steps decode the
eager fused steps' logits into the same cache state (ShadowKV), as the full caches' do (the ``full_graph``
baseline of benchmarks/kv/_kv_graph.py, captured once per length; a transformers StaticCache under one graph).

The GPU comparisons are in fp32 (the fused kernel's IEEE path) and allow 1e-5: a replay launches the same kernels
on the same shapes and inputs as the eager step, so the logits agree bit for bit unless cuBLAS picks another
algorithm under capture (it may: its workspace differs per stream); a wrong position, a token written to the wrong
tail slot or a stale selection moves the logits by far more (the tiny model's attention is peaked)."""

import pytest
import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import Cache

from benchmarks.kv._kv_graph import PerLengthGraph
from benchmarks.kv._kv_caches import PreallocatedLayer
from eval_helpers import tiny_llama
from neutrain import compat
from neutrain.eval.kv.decode_graph import (GraphCaptureError, HostCounts, capturable_steps, capture_decode_step,
                                           decode_step, start_positions)
from neutrain.eval.kv.shadowkv import ShadowKVCache, enable_shadowkv, shadowkv_cache_factory

# A 136-token prompt takes the sparse path (16 chunks of 8 after 4 local chunks, 2 outliers): as test_shadowkv.py.
PROMPT = 136
OPTS = dict(budget=24, rank=8, chunk_size=8, outliers=2, min_prefill=64, min_selected_chunks=0)


def _step(model, cache, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True, logits_to_keep=1,
                     **{compat.cache_forward_kwarg(model): cache}).logits


def _prefilled(model, make, ids, prompt: int = PROMPT):
    cache = make()
    _step(model, cache, ids[:, :prompt])
    return cache


@pytest.mark.parametrize("case, options, expected", [
    ("unfused", dict(), "capture needs fused_decode=True"),
    ("exact keys", dict(fused_decode=True, exact_keys=True), "capture needs exact_keys=False"),
    ("selection log", dict(fused_decode=True, log_selection=True), "capture needs log_selection=False"),
    ("dense", dict(fused_decode=True), "layer 0 is dense, not sparse"),
    ("phase marks", dict(fused_decode=True), "phase marks are being recorded"),
])
def test_a_step_that_cannot_be_replayed_is_refused_with_its_reason(case, options, expected):
    model = tiny_llama(layers=2, hidden=128)
    ids = torch.randint(0, 97, (1, PROMPT))
    with shadowkv_cache_factory(model, **{**OPTS, **options}) as make:
        cache = _prefilled(model, make, ids, prompt=40 if case == "dense" else PROMPT)  # 40 < min_prefill: dense
        if case == "phase marks":
            cache.phase_events = []
        with pytest.raises(GraphCaptureError, match=expected):
            capture_decode_step(model, cache, batch=1)


def test_a_cache_that_grows_by_concatenation_is_refused():
    model = tiny_llama(layers=2)
    cache = DynamicCache(config=model.config)
    _step(model, cache, torch.randint(0, 97, (1, 8)))
    with pytest.raises(GraphCaptureError, match="DynamicLayer changes its tensors' shapes"):
        capturable_steps(cache)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_capture_without_cuda_is_refused():
    model = tiny_llama(layers=2, hidden=128)
    with shadowkv_cache_factory(model, fused_decode=True, **OPTS) as make:
        cache = _prefilled(model, make, torch.randint(0, 97, (1, PROMPT)))
        with pytest.raises(GraphCaptureError, match="a CUDA graph needs CUDA"):
            capture_decode_step(model, cache, batch=1)


@pytest.mark.slow
def test_host_counts_advance_as_eager_steps_do_and_the_free_slots_bound_a_capture():
    """What a capture takes back and adds per replay: one eager step's delta of every host count, applied twice,
    leaves what two more eager steps leave (the tail views re-cut to the count); the steps a capture allows are the
    tail's free slots, back to ``tail_capacity`` less one once a full tail regrows."""
    model = tiny_llama(layers=2, hidden=128)  # head dim 32: the fused kernel's halves of 16 channels
    ids = torch.randint(0, 97, (2, PROMPT + 8))
    with shadowkv_cache_factory(model, fused_decode=True, fused_store_reads=True, tail_capacity=4, **OPTS) as make:
        cache = _prefilled(model, make, ids)
        free = [capturable_steps(cache)]  # before the first step: the slots its move into buffers gives
        _step(model, cache, ids[:, PROMPT : PROMPT + 1])
        free.append(capturable_steps(cache))
        assert start_positions(cache, 2, "cpu").tolist() == [[PROMPT + 1]] * 2
        counts = HostCounts(cache)
        before = counts.snapshot()
        _step(model, cache, ids[:, PROMPT + 1 : PROMPT + 2])
        free.append(capturable_steps(cache))
        per_step = counts.delta(before)
        assert per_step[:4] == [1, 1, 1, 1]  # each layer's seen and tail_count
        _step(model, cache, ids[:, PROMPT + 2 : PROMPT + 3])
        free.append(capturable_steps(cache))
        after_two = counts.snapshot()
        assert cache.counters["fused_steps"] == 2 * 3 and after_two != before
        counts.restore(before)
        assert counts.snapshot() == before and cache.layers[1].tail_k.shape[2] == cache.layers[1].tail_count
        counts.advance(2)
        assert counts.snapshot() == after_two
        for layer in cache.layers:
            assert layer.tail_k.shape[2] == layer.tail_count == int(layer.tail_len)
            assert layer.tail_k.data_ptr() == layer._tail_kbuf.data_ptr()
        for i in range(3, 6):  # to the last free slot, then a step that regrows the buffers
            _step(model, cache, ids[:, PROMPT + i : PROMPT + i + 1])
            free.append(capturable_steps(cache))
    assert free == [4, 4, 3, 2, 1, 0, 3]


@pytest.mark.slow
def test_the_captured_step_run_eagerly_decodes_as_the_model_does():
    """The callable a graph captures, run eagerly: positions given from the cache's length and advanced in place
    give the logits of transformers' own steps (positions from ``get_seq_length``), on the same cache state."""
    model = tiny_llama(layers=2, hidden=128)
    ids = torch.randint(0, 97, (2, PROMPT + 3))
    with shadowkv_cache_factory(model, fused_decode=True, fused_store_reads=True, tail_capacity=2, **OPTS) as make:
        by_model, static = _prefilled(model, make, ids), _prefilled(model, make, ids)
        positions = start_positions(static, 2, "cpu")
        for i in range(3):  # the tail's 2 free slots, then a step that regrows them
            step_ids = ids[:, PROMPT + i : PROMPT + i + 1]
            with torch.no_grad():
                got = decode_step(model, static, step_ids, positions)
            torch.testing.assert_close(got, _step(model, by_model, step_ids), atol=0, rtol=0)
        assert positions.tolist() == [[PROMPT + 3]] * 2 and static.layers[0].seen == PROMPT + 3
        wrong = start_positions(static, 2, "cpu") - 1
        with torch.no_grad():
            moved = decode_step(model, static, ids[:, -1:], wrong) - _step(model, by_model, ids[:, -1:])
        assert moved.abs().max() > 1e-3  # one position off changes the logits: the comparison above can fail


# ---------------------------------------------------------------- on the GPU
def _eager_and_graphed(store_reads: bool, steps: int, tail_capacity: int, **capture):
    """The same prompt prefilled into two caches; ``steps`` eager fused steps on one, the graph's replays on the
    other (the first ids given at capture, the next copied in per step). The model is the test's own and stays
    switched to ShadowKV: a recapture or an eager step later runs its attention again."""
    model = enable_shadowkv(tiny_llama(layers=2, hidden=128).cuda(),  # fp32: the fused kernel's IEEE path
                            **OPTS, fused_decode=True, fused_store_reads=store_reads, tail_capacity=tail_capacity,
                            device_value_rows=1)  # row 0's values in pinned host memory, row 1's on the GPU
    make = lambda: ShadowKVCache.for_model(model)  # noqa: E731
    ids = torch.randint(0, 97, (2, PROMPT + steps), device="cuda")
    eager_cache, graph_cache = _prefilled(model, make, ids), _prefilled(model, make, ids)
    for a, b in zip(eager_cache.layers, graph_cache.layers):  # else the comparison below says nothing
        assert torch.equal(a.u, b.u) and torch.equal(a.sv, b.sv) and torch.equal(a.landmarks, b.landmarks)
    eager = [_step(model, eager_cache, ids[:, PROMPT + i : PROMPT + i + 1]) for i in range(steps)]
    captured = capture_decode_step(model, graph_cache, input_ids=ids[:, PROMPT : PROMPT + 1], **capture)
    return model, ids, eager_cache, graph_cache, captured, eager


@pytest.mark.gpu
@pytest.mark.parametrize("store_reads", [False, True], ids=["gathered_values", "store_reads"])
def test_graphed_steps_decode_the_eager_fused_steps(store_reads, record_property):
    """Seven replays over a tail of 3 free slots (two recaptures, the buffers regrown outside the graph) give the
    eager fused steps' logits, and leave the same cache: lengths on the host and the device, the tail's tokens,
    the counters, the kernel launches counted per replay."""
    from neutrain.kernels import shadowkv_fused_decode as kernels

    steps = 7
    launches = kernels.COUNTERS["shadowkv_fused_decode"]
    model, ids, eager_cache, graph_cache, captured, eager = _eager_and_graphed(store_reads, steps, 3)
    eager_launches = kernels.COUNTERS["shadowkv_fused_decode"] - launches
    launches = kernels.COUNTERS["shadowkv_fused_decode"]
    graphed = [captured.step(ids[:, PROMPT + i : PROMPT + i + 1]).clone() for i in range(steps)]
    torch.cuda.synchronize()
    diff = max((g - e).abs().max().item() for g, e in zip(graphed, eager))
    record_property("max_abs_logit_difference", diff)
    record_property("bit_exact", all(torch.equal(g, e) for g, e in zip(graphed, eager)))
    for g, e in zip(graphed, eager):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    assert captured.captures == 3 and captured.replays == steps
    assert kernels.COUNTERS["shadowkv_fused_decode"] - launches == eager_launches == 2 * steps
    for a, b in zip(eager_cache.layers, graph_cache.layers):
        assert a.seen == b.seen == PROMPT + steps
        assert a.tail_count == b.tail_count == int(a.tail_len) == int(b.tail_len) == b.tail_k.shape[2]
        torch.testing.assert_close(b.tail_k, a.tail_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b.tail_v, a.tail_v, atol=1e-5, rtol=1e-5)
    assert graph_cache.counters == eager_cache.counters
    assert captured.positions.tolist() == [[PROMPT + steps]] * 2


@pytest.mark.gpu
def test_a_capture_whose_tail_slots_are_used_refuses_then_recaptures():
    """``recapture_when_full=False``: the replays its 2 free slots allow, then a one-line refusal that says so;
    ``recapture()`` grows the tail outside the graph and the next replay decodes the eager third step. An eager
    step taken outside the graph is noticed: the next replay captures again from the moved cache."""
    model, ids, eager_cache, graph_cache, captured, eager = _eager_and_graphed(True, 4, 2, recapture_when_full=False)
    got = [captured.step(ids[:, PROMPT + i : PROMPT + i + 1]).clone() for i in range(2)]
    with pytest.raises(GraphCaptureError, match="replayed the 2 steps its free positions allow"):
        captured.step(ids[:, PROMPT + 2 : PROMPT + 3])
    assert graph_cache.layers[0].seen == PROMPT + 2  # the refused step left the cache as it was
    captured.recapture()
    got.append(captured.step(ids[:, PROMPT + 2 : PROMPT + 3]).clone())
    assert captured.captures == 2
    _step(model, graph_cache, ids[:, PROMPT + 3 : PROMPT + 4])  # eager, outside the graph
    assert graph_cache.layers[0].seen == PROMPT + 4
    for g, e in zip(got, eager):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    captured.step(ids[:, PROMPT + 3 : PROMPT + 4])
    assert captured.captures == 3 and captured.positions.tolist() == [[PROMPT + 5]] * 2


@pytest.mark.gpu
def test_graphed_static_full_cache_decodes_its_eager_steps():
    """One graph for a transformers StaticCache: its replays (mask and writes from its device-held length) give
    its eager steps' logits; past its last free position it is refused, and cannot be captured again."""
    model = tiny_llama(layers=2, hidden=128).cuda()
    ids = torch.randint(0, 97, (2, 24 + 5), device="cuda")
    caches = []
    for _ in range(2):
        cache = StaticCache(config=model.config, max_cache_len=24 + 5)
        _step(model, cache, ids[:, :24])
        caches.append(cache)
    eager = [_step(model, caches[0], ids[:, 24 + i : 25 + i]) for i in range(5)]
    captured = capture_decode_step(model, caches[1], input_ids=ids[:, 24:25], recapture_when_full=False)
    assert captured.steps_left == 5
    for i in range(5):
        torch.testing.assert_close(captured.step(ids[:, 24 + i : 25 + i]), eager[i], atol=1e-5, rtol=1e-5)
    assert int(caches[1].layers[0].cumulative_length) == 29
    with pytest.raises(GraphCaptureError, match="replayed the 5 steps"):
        captured.step()
    with pytest.raises(GraphCaptureError, match="StaticLayer cache is full"):
        captured.recapture()


@pytest.mark.gpu
def test_the_full_cache_graphed_per_length_decodes_its_eager_steps():
    """The ``full_graph`` baseline: the preallocated full cache's step captured at each length (the capture's
    Python pass moving the host length as the replay moves the buffers) gives the eager steps' logits and cache."""
    model = tiny_llama(layers=2, hidden=128).cuda()
    cfg = model.config
    shape = (2, cfg.num_key_value_heads, 20 + 8, cfg.hidden_size // cfg.num_attention_heads)
    states = [(torch.randn(shape, device="cuda"), torch.randn(shape, device="cuda")) for _ in range(2)]  # per layer
    eager_cache, graph_cache = (Cache(layers=[PreallocatedLayer(k.clone(), v.clone(), 20) for k, v in states])
                                for _ in range(2))
    ids = torch.randint(0, 97, (2, 5), device="cuda")
    graphs = PerLengthGraph(model, graph_cache, 2)
    for i in range(5):
        eager = _step(model, eager_cache, ids[:, i : i + 1])
        graphs.prepare()
        with torch.inference_mode():  # the graph's input ids are an inference tensor
            graphs.ids.copy_(ids[:, i : i + 1])
        graphs.step()
        torch.testing.assert_close(graphs.logits, eager, atol=1e-5, rtol=1e-5)
    assert graphs.captures == 5
    for a, b in zip(eager_cache.layers, graph_cache.layers):
        assert a.length == b.length == 25
        torch.testing.assert_close(b.buf_k[:, :, :25], a.buf_k[:, :, :25], atol=1e-5, rtol=1e-5)
