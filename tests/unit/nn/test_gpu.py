"""GPU checks: Triton codec path parity with prefetching, and device memory after conversion."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from neutrain.nn import DECODE_BUFFERS, PREFETCHER, compress_model, compressed_weights
from neutrain.optim import LOMO

from .nn_helpers import enable_checkpointing, token_batches, train, weights

pytestmark = pytest.mark.gpu


def _llama(hidden, layers, vocab, tie=False):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, vocab_size=vocab, tie_word_embeddings=tie)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().train()


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("tie", [False, True])
def test_gpu_compressed_matches_dense_with_prefetch(tie, checkpointing):
    dense = _llama(256, 3, 512, tie)
    compressed = copy.deepcopy(dense)
    compress_model(compressed, progress=False)
    if checkpointing:
        enable_checkpointing(dense)
        enable_checkpointing(compressed)
    start = weights(dense)
    data = [ids.cuda() for ids in token_batches(4, batch=4, length=64)]
    train(dense, LOMO(dense.parameters(), lr=5e-2, seed=2), data)
    hits, launched, mismatches = DECODE_BUFFERS.prefetch_hits, PREFETCHER.launched, PREFETCHER.mismatches
    PREFETCHER.reset()
    PREFETCHER.enabled = True
    try:
        train(compressed, LOMO(compressed.parameters(), lr=5e-2, seed=2), data)
        torch.cuda.synchronize()
    finally:
        PREFETCHER.enabled = False
        PREFETCHER.reset()
    # Steps 2-4 follow step 1's recorded order (recomputes included): every decode ahead is used.
    launched = PREFETCHER.launched - launched
    assert launched > 0 and DECODE_BUFFERS.prefetch_hits - hits == launched, (launched, DECODE_BUFFERS.prefetch_hits - hits)
    assert PREFETCHER.mismatches == mismatches
    a, b = weights(dense), weights(compressed)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    changed = sum(int((a[n] != start[n]).sum()) for n in a)
    assert changed >= sum(v.numel() for v in a.values()) / 2


def test_gpu_memory_after_conversion_is_the_compressed_total():
    DECODE_BUFFERS.clear()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    model = _llama(1024, 4, 8192)
    dense_bytes = torch.cuda.memory_allocated() - base
    report = compress_model(model, progress=False)
    torch.cuda.synchronize()
    # The decode buffers reserved once at their final sizes are working memory, not weights.
    after = torch.cuda.memory_allocated() - base - DECODE_BUFFERS.nbytes()
    compressed = sum(w.nbytes for w in compressed_weights(model))
    assert report.bytes_after == pytest.approx(after, rel=0.02, abs=1 << 20), (report.bytes_after, after)
    assert after < 0.8 * dense_bytes, (after, dense_bytes)
    assert compressed < 0.75 * report.weight_bytes_before
