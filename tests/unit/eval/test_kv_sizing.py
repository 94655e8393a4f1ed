"""The throughput part's batch for each cache setting comes from what a sequence really holds
(benchmarks/kv/_kv_sizing.py): the stored bytes measured on the real cache, plus the build's and the decode's
transient memory. Measured here on CPU with a tracker of live tensor bytes (``LiveBytes``), on small shapes,
and planned on a fake Llama-3-8B: the sizing by stored bytes alone ran MiniCache merge + 4-bit out of memory
at 32K on an 80 GB H100."""

import pytest
import transformers

from benchmarks.kv import _kv_sizing as sizing
from benchmarks.kv._kv_caches import minicache_cache, prepare_fused
from benchmarks.kv._kv_throughput import llama3_8b_config

from eval_helpers import LiveBytes
from neutrain import compat

SETTINGS = {"merge_4bit": dict(quant_bits=4), "4bit_only": dict(quant_bits=4, start_layer=8),
            "merge": dict(quant_bits=None)}


def small_config():
    return transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=128)


def _build(cfg, batch, ctx, chunk, options):
    return prepare_fused(minicache_cache(None, cfg, batch, ctx, "cpu", chunk=chunk, gamma=0.05, quant_group=64,
                                     fused_decode=True, **options))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_the_stored_bytes_formula_is_what_the_cache_measures(name):
    """The layout's arithmetic (merged pairs share one direction, 4-bit codes packed with their ranges, fp32 norms,
    retained rows) gives MiniCache's measured bytes exactly, so a plan for shapes not built here can use it."""
    cfg, batch, ctx = small_config(), 2, 1024
    cache = minicache_cache(None, cfg, batch, ctx, "cpu", chunk=256, gamma=0.05, quant_group=64, **SETTINGS[name])
    pairs = sum(layer.role == "first" for layer in cache.layers)
    retained = cache.retained_tokens / max(1, 2 * pairs * batch * ctx)
    options = SETTINGS[name]
    planned = sizing.minicache_stored_bytes_per_token(cfg, options["quant_bits"], 64, options.get("start_layer"), retained)
    assert planned * batch * ctx == pytest.approx(cache.stored_bytes(), rel=1e-9)


@pytest.mark.slow
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


@pytest.mark.slow
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


H200_CARD = int(139.8 * sizing.GIB)
LLAMA3_8B_WEIGHTS = int(14.96 * sizing.GIB)
MINICACHE_ROWS = {  # throughput row -> (quant_bits, start_layer, fused decode)
    "minicache_merge_4bit": (4, None, True), "minicache_4bit_only": (4, 32, True), "minicache_merge": (None, None, True),
    "minicache_merge_4bit_restore": (4, None, False)}


def _first_step_restores_a_layer(quant_bits, fused) -> bool:
    """Whether the benchmark's cache restores a compressed layer to bf16 in its first decode step: a fused cache
    that has not seen the fused attention does, for the layer whose update runs before the attention is reached."""
    cache = minicache_cache(None, small_config(), 1, 256, "cpu", chunk=128, gamma=0.05, quant_group=64,
                       quant_bits=quant_bits, fused_decode=fused)
    return not fused or (quant_bits is not None and not cache.attention_hooked)


@pytest.mark.parametrize("ctx", [32768, 65536])
@pytest.mark.parametrize("row", sorted(MINICACHE_ROWS))
def test_the_llama3_8b_minicache_rows_fit_an_h200(row, ctx):
    """Llama-3-8B shapes on a 139.8 GiB H200 (6 GiB margin): the batch the benchmark sizes for each MiniCache row
    stays within what the row's bytes, counted from shapes, say fits: what it stores (1% of tokens retained), its
    fused factors (two fp32 per token and side of a pair), then the larger of the chunked prefill's transient and
    the first decode step's, which holds a bf16 copy of a restored layer (keys and values, the dequantized and
    concatenated tensors: ``RESTORE_BYTES``) wherever that step restores one. The H200 run sized merge + 4-bit at
    125 sequences at 32K from its stored bytes and the prefill, and the first step's restored layer 0 took the
    7.81 GiB that ran it out of memory."""
    cfg = llama3_8b_config()
    quant_bits, start_layer, fused = MINICACHE_ROWS[row]
    merged = start_layer is None
    budget = sizing.Budget(card=H200_CARD, weights=LLAMA3_8B_WEIGHTS, margin=6 * sizing.GIB)
    heads, d = sizing.kv_width(cfg)
    pairs = 8 if merged else 0
    stored = sizing.minicache_stored_bytes_per_token(cfg, quant_bits, 64, start_layer, 0.01) * ctx
    stored += pairs * 2 * 2 * 4 * ctx if fused else 0
    batch = budget.batch(stored + sizing.minicache_transient_bytes_per_seq(cfg, ctx, 1024, quant_bits, merged, fused))
    logits_and_activations = sizing.decode_bytes_per_seq(cfg, ctx)
    restore = sizing.RESTORE_BYTES["minicache"] * ctx * heads * d if _first_step_restores_a_layer(quant_bits, fused) \
        else 0
    norms = (10 * min(4096, ctx) if quant_bits else 4 * ctx) * heads * d if merged and fused else 0
    first_step = logits_and_activations + max(restore, norms)
    prefill = sizing.minicache_build_bytes_per_seq(cfg, ctx, 1024, quant_bits, merged)
    need = batch * (stored + max(prefill, first_step))
    assert batch >= 8 and need <= budget.headroom, (batch, need / sizing.GIB, budget.headroom / sizing.GIB)


@pytest.mark.slow
def test_a_fused_cache_decodes_every_layer_in_the_kernel_from_its_first_step():
    """The benchmark fills its MiniCache without the model; its first decode step must still run every layer through
    the fused kernel. Before, layer 0 took the restore path (the cache had not yet seen the fused attention), and
    its bf16 copy, one layer's keys of every sequence, was the largest tensor of the step."""
    import torch

    from neutrain.eval.kv import disable_minicache_attention, enable_minicache_attention

    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=128)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    batch, ctx = 2, 512
    cache = minicache_cache(model, cfg, batch, ctx, "cpu", chunk=128, gamma=0.05, quant_bits=4, quant_group=64,
                       start_layer=cfg.num_hidden_layers, fused_decode=True)
    enable_minicache_attention(model)
    try:
        with LargestTensor() as largest, torch.inference_mode():
            for _ in range(2):
                model(input_ids=torch.randint(0, 100, (batch, 1)), use_cache=True, logits_to_keep=1,
                      **{compat.cache_forward_kwarg(model): cache})
    finally:
        disable_minicache_attention(model)
    assert cache.fused_steps == 2 * cfg.num_hidden_layers  # both steps, every layer
    restored_layer = batch * ctx * 64 * 2  # one layer's keys in bf16
    assert largest.nbytes < restored_layer / 2, largest.nbytes


class LargestTensor:
    """The largest tensor any op makes inside the block, in bytes."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        outer = self
        self.nbytes = 0

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if hasattr(t, "untyped_storage") and t.numel():
                        outer.nbytes = max(outer.nbytes, t.numel() * t.element_size())
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


def test_the_backoff_halves_down_to_batch_1_and_frees_each_failed_attempt_first():
    """Every batch above 1 runs out of memory (a fake row): the back-off halves to 1, frees memory before each
    retry, records every attempt, and returns batch 1's result. The H200 run gave up after 125, 93, 69."""
    import torch

    tried, released = [], []

    def attempt(batch):
        tried.append(batch)
        if batch > 1:
            raise torch.OutOfMemoryError(f"CUDA out of memory at {batch}")
        return {"batch": batch}

    out, attempts = sizing.run_with_backoff(125, attempt, lambda: released.append(tried[-1]))
    assert out == {"batch": 1}
    assert tried == [125, 62, 31, 15, 7, 3, 1] and released == tried[:-1]
    assert [a["batch"] for a in attempts] == tried
    assert all("out of memory" in a["error"] for a in attempts[:-1]) and "error" not in attempts[-1]


def test_the_backoff_raises_when_batch_1_fails_too():
    import torch

    def attempt(batch):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError, match="at batch 1"):
        sizing.run_with_backoff(4, attempt, lambda: None)


@pytest.mark.slow
def test_a_failed_attempt_leaves_no_cache_on_the_model():
    """The attention routing keeps the last cache on each attention module; after a failed attempt that is the
    whole failed cache, and the next attempt built beside it. Releasing drops it."""
    import gc
    import weakref

    import torch

    from benchmarks.kv._kv_caches import release_memory
    from neutrain.eval.kv import MiniCache, disable_minicache_attention, enable_minicache_attention

    cfg = small_config()
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    enable_minicache_attention(model)
    try:
        cache = MiniCache(cfg, quant_bits=4, quant_group=64)
        with torch.inference_mode():
            model(input_ids=torch.randint(0, 100, (1, 8)), use_cache=True, **{compat.cache_forward_kwarg(model): cache})
        ref = weakref.ref(cache)
        del cache
        gc.collect()
        assert ref() is not None  # held by the attention modules
        release_memory(model, cuda=False)
        assert ref() is None
    finally:
        disable_minicache_attention(model)
