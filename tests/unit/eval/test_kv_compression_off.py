"""The gate of the KV caches: with compression off, every cache is token-identical to ``DynamicCache``.

One table, :data:`CASES`, names every cache the evaluation and the throughput benchmark decode with, each
with its compression switched off (MiniCache keeping every token of every pair, on the restore path and
the fused kernel's; ShadowKV at full rank with every chunk selected, values on the device, offloaded, or
both in one batch, and through its fused decode kernel; the pruned cache unpruned; the benchmark's
preallocated full cache; the decode engine; kvpress presses at ratio 0). Each decodes the same two prompts greedily and must give DynamicCache's
tokens, on this CPU and, the same table, on a GPU (``-m gpu``: the Triton gather, the fused MiniCache
kernel and the pinned host values run there). :func:`test_every_cache_kind_is_in_the_table` fails when a
cache kind is added without a case here.

transformers' ``QuantizedCache`` has no such setting: it quantizes the whole prompt whatever its residual
length (``QuantizedLayer.update``), so it is listed in :data:`NO_OFF_SWITCH` instead.
"""

from contextlib import contextmanager

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from eval_helpers import tiny_llama
from neutrain.eval.kv import baselines
from neutrain.eval.kv.registry import kv_cache_specs
from neutrain.eval.loop import engine_greedy_decode, greedy_decode, kv_cache_factory

PROMPT, NEW = 136, 8
# ShadowKV's sparse path on a 136-token prompt: 16 chunks of 8 after the local window (test_shadowkv.py's SMALL)
SHADOWKV_OFF = dict(budget=10_000, rank=10_000, chunk_size=8, outliers=2, min_prefill=64, min_selected_chunks=0)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=4, hidden=128)  # head dim 32: the fused MiniCache kernel's minimum on a GPU


@pytest.fixture(scope="module")
def prompts():
    torch.manual_seed(1)
    return torch.randint(0, 97, (2, PROMPT))


@contextmanager
def preallocated(model):
    """The throughput benchmark's full cache: one buffer per layer, written in place (fp32, like the model)."""
    from benchmarks.kv._kv_caches import PreallocatedLayer

    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads

    def make():
        shape = (2, cfg.num_key_value_heads, PROMPT + NEW, d)
        device = model.device
        return Cache(layers=[PreallocatedLayer(torch.zeros(shape, device=device), torch.zeros(shape, device=device), 0)
                             for _ in range(cfg.num_hidden_layers)])

    yield make


@contextmanager
def press(model, name):
    pytest.importorskip("kvpress")
    with baselines.press_cache_factory(model, name, 0.0) as make:
        yield make


CASES = {
    "full": lambda m: kv_cache_factory(m, "full"),
    "minicache_retain_every_token": lambda m: kv_cache_factory(m, "minicache", gamma=1.0, merge_every=4,
                                                               fused_decode=False),
    "minicache_retain_every_token_fused_decode": lambda m: kv_cache_factory(m, "minicache", gamma=1.0,
                                                                            merge_every=None, fused_decode=True),
    "minicache_no_pair_similar_enough": lambda m: kv_cache_factory(m, "minicache", min_similarity=1.01),
    "shadowkv_full_rank_every_chunk_device_values": lambda m: kv_cache_factory(m, "shadowkv", offload_values=False,
                                                                                **SHADOWKV_OFF),
    "shadowkv_full_rank_every_chunk_offloaded_values": lambda m: kv_cache_factory(m, "shadowkv", offload_values=True,
                                                                                   **SHADOWKV_OFF),
    "shadowkv_full_rank_every_chunk_mixed_rows": lambda m: kv_cache_factory(m, "shadowkv", offload_values=True,
                                                                             device_value_rows=1, **SHADOWKV_OFF),
    "shadowkv_full_rank_every_chunk_fused_decode": lambda m: kv_cache_factory(m, "shadowkv", offload_values=True,
                                                                               device_value_rows=1, fused_decode=True,
                                                                               **SHADOWKV_OFF),
    "shadowkv_exact_keys_every_chunk": lambda m: kv_cache_factory(m, "shadowkv", exact_keys=True, rank=2,
                                                                  **{k: v for k, v in SHADOWKV_OFF.items() if k != "rank"}),
    "pruned_cache_unpruned": lambda m: nullfactory(lambda: baselines.PrunedCache(config=m.config)),
    "throughput_preallocated_full_cache": preallocated,
    **{f"kvpress_{name}_ratio_0": (lambda m, _n=name: press(m, _n)) for name in sorted(baselines.PRESSES)},
}
NO_OFF_SWITCH = {"quantized": "QuantizedCache quantizes the whole prompt at prefill whatever its residual length"}


@contextmanager
def nullfactory(make):
    yield make


@pytest.fixture(scope="module")
def reference(model, prompts):
    return greedy_decode(model, prompts, NEW, DynamicCache(config=model.config))["tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_with_compression_off_every_cache_decodes_the_dynamic_cache_tokens(model, prompts, reference, case):
    with CASES[case](model) as make:
        cache = make()
        tokens = greedy_decode(model, prompts, NEW, cache)["tokens"]
    assert torch.equal(tokens, reference), case
    counters = getattr(cache, "counters", {})
    if case.startswith("shadowkv"):  # the sparse path ran, not the dense fallback
        assert counters["sparse_steps"] > 0 and counters["dense_prefill"] == 0, counters
        assert (counters["fused_steps"] > 0) == case.endswith("fused_decode"), counters
    if case == "minicache_retain_every_token_fused_decode":
        assert cache.fused_steps > 0 and cache.merges > 0
    if case == "minicache_retain_every_token":
        assert cache.merges > 1 and cache.retained_tokens > 0


@pytest.fixture(scope="module")
def gpu_model():
    return tiny_llama(layers=4, hidden=128).cuda()


@pytest.fixture(scope="module")
def gpu_reference(gpu_model, prompts):
    return greedy_decode(gpu_model, prompts.cuda(), NEW, DynamicCache(config=gpu_model.config))["tokens"]


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_with_compression_off_every_cache_decodes_the_dynamic_cache_tokens_on_the_gpu(gpu_model, prompts,
                                                                                      gpu_reference, case):
    test_with_compression_off_every_cache_decodes_the_dynamic_cache_tokens(gpu_model, prompts.cuda(), gpu_reference,
                                                                          case)


@pytest.mark.slow
def test_the_decode_engine_decodes_the_dynamic_cache_tokens(model, prompts, reference):
    """The evaluation loop's full cache (a static cache in the decode engine, one prompt at a time)."""
    from neutrain.decode.engine import DecodeEngine

    engine = DecodeEngine(model, max_len=PROMPT + NEW)
    for row in range(prompts.shape[0]):
        tokens = engine_greedy_decode(engine, prompts[row : row + 1], NEW)["tokens"]
        assert torch.equal(tokens, reference[row : row + 1])


def test_every_cache_kind_is_in_the_table():
    """Each kind the evaluation loop and the baselines know has a compression-off case (or a reason it has none)."""
    covered = {case.split("_")[0] for case in CASES} | set(NO_OFF_SWITCH)
    kinds = {spec.name.split(":")[0] for spec in kv_cache_specs()}  # every press of kvpress: one family
    assert kinds <= covered, sorted(kinds - covered)
    assert {f"kvpress_{n}_ratio_0" for n in baselines.PRESSES} <= set(CASES)
