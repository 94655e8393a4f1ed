"""The throughput part's batch for each cache setting comes from what a sequence really holds
(benchmarks/_kv_sizing.py): the stored bytes measured on the real cache, plus the build's and the decode's
transient memory. Measured here on CPU with a tracker of live tensor bytes (``LiveBytes``), on small shapes,
and planned on a fake Llama-3-8B: the sizing by stored bytes alone ran MiniCache merge + 4-bit out of memory
at 32K on an 80 GB H100."""

import pytest
import transformers

from benchmarks import _kv_sizing as sizing
from benchmarks._kv_throughput import _minicache, _prepare_fused, llama3_8b_config

from eval_helpers import LiveBytes

SETTINGS = {"merge_4bit": dict(quant_bits=4), "4bit_only": dict(quant_bits=4, start_layer=8),
            "merge": dict(quant_bits=None)}


def small_config():
    return transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=128)


def _build(cfg, batch, ctx, chunk, options):
    return _prepare_fused(_minicache(None, cfg, batch, ctx, "cpu", chunk=chunk, gamma=0.05, quant_group=64,
                                     fused_decode=True, **options))


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_the_stored_bytes_formula_is_what_the_cache_measures(name):
    """The layout's arithmetic (merged pairs share one direction, 4-bit codes packed with their ranges, fp32 norms,
    retained rows) gives MiniCache's measured bytes exactly, so a plan for shapes not built here can use it."""
    cfg, batch, ctx = small_config(), 2, 1024
    cache = _minicache(None, cfg, batch, ctx, "cpu", chunk=256, gamma=0.05, quant_group=64, **SETTINGS[name])
    pairs = sum(layer.role == "first" for layer in cache.layers)
    retained = cache.retained_tokens / max(1, 2 * pairs * batch * ctx)
    options = SETTINGS[name]
    planned = sizing.minicache_stored_bytes_per_token(cfg, options["quant_bits"], 64, options.get("start_layer"), retained)
    assert planned * batch * ctx == pytest.approx(cache.stored_bytes(), rel=1e-9)


@pytest.mark.parametrize("name", sorted(SETTINGS))
@pytest.mark.parametrize("ctx, chunk", [(2048, 512), (2048, 256)])
def test_a_build_holds_no_more_than_its_stored_bytes_and_the_planned_transient(name, ctx, chunk):
    """Everything alive after the build is counted by ``stored_bytes`` (the fused decode's state included), and
    the build's peak stays under stored + the planned transient, which the stored bytes alone miss."""
    cfg, batch = small_config(), 2
    options = SETTINGS[name]
    merged = options.get("start_layer") is None
    with LiveBytes() as live:
        cache = _build(cfg, batch, ctx, chunk, options)
        stored = cache.stored_bytes()
        peak = live.peak
        slack = 0 if options["quant_bits"] else 256 * (cfg.num_hidden_layers + 2) * 2 * 2 * 64 * 2 * batch
        assert stored <= live.now <= stored + slack  # plain stores keep <= 256 spare rows (not counted)
    transient = sizing.minicache_build_bytes_per_seq(cfg, ctx, chunk, options["quant_bits"], merged)
    assert peak - stored <= batch * transient
    assert peak - stored > 0.2 * batch * transient  # the plan is a bound, not a wild one


def test_the_old_batch_overflows_a_card_the_new_batch_fits():
    """On a pretend card, the batch from the stored bytes alone builds past the card; the planned batch does not."""
    cfg, ctx, chunk, options = small_config(), 4096, 256, SETTINGS["merge_4bit"]
    stored = _build(cfg, 1, ctx, chunk, options).stored_bytes()
    budget = sizing.Budget(card=12 * stored + 10**6, weights=10**6, margin=0)
    transient = sizing.minicache_build_bytes_per_seq(cfg, ctx, chunk, 4, merged=True)
    old, new = budget.batch(stored), budget.batch(stored + transient)
    assert old == 12 and 1 < new < old
    for batch, fits in ((old, False), (new, True)):
        with LiveBytes() as live:
            _build(cfg, batch, ctx, chunk, options)
        assert (budget.weights + live.peak <= budget.card) is fits, (batch, live.peak, budget.headroom)


def test_llama3_8b_at_32k_on_an_80gb_card():
    """The plan for the run that failed: Llama-3-8B shapes, 32K tokens, an 80 GB H100 (79.2 GiB, 15.0 GiB of bf16
    weights, 6 GiB margin). Sized by the stored bytes alone, merge + 4-bit took 67 sequences and its 4,096-token
    merge blocks (and, before the store fix, the block each 4-bit layer kept) did not fit beside them."""
    cfg, ctx = llama3_8b_config(), 32768
    budget = sizing.Budget(card=int(79.18 * sizing.GIB), weights=int(14.96 * sizing.GIB), margin=6 * sizing.GIB)
    stored = sizing.minicache_stored_bytes_per_token(cfg, 4, 64, retained_fraction=0.01) * ctx
    old = budget.batch(stored)
    pinned_block = cfg.num_hidden_layers * 2 * 4096 * 1024 * 2 * 3 / 4  # exact layers' K+V, pairs' directions
    old_need = old * (stored + sizing.minicache_build_bytes_per_seq(cfg, ctx, 4096, 4, True) + pinned_block)
    assert old == 67 and old_need > budget.headroom
    per_seq = stored + max(sizing.minicache_build_bytes_per_seq(cfg, ctx, 1024, 4, True),
                           sizing.decode_bytes_per_seq(cfg, ctx))
    new = budget.batch(per_seq)
    assert 50 <= new < old and budget.predicted_peak(new, per_seq) <= budget.card - budget.margin
    # 64K: half the batch, still above the 18 the failing run's retries reached
    assert budget.batch(2 * per_seq) >= 28
