import pytest
import torch
from transformers import DynamicCache

from eval_helpers import decode_logits, tiny_llama
from neutrain import compat
from neutrain.eval.kv import ShadowKVCache, disable_shadowkv, enable_shadowkv
from neutrain.eval.kv.shadowkv import (
    apply_rope,
    chunk_tokens,
    invert_rope,
    low_rank_keys,
    rope_cos_sin,
    rebuild_keys,
    pad_landmarks,
    select_chunks,
)
from neutrain.eval.loop import greedy_decode

# Lowered thresholds so a 136-token prompt takes the sparse path: 16 chunks of 8 after
# 4 local chunks, 2 outliers, 14 selectable. Chunks of 8 whatever the budget (min_selected_chunks=0):
# these tests check the paper's geometry; test_a_small_budget_is_spent_in_finer_chunks the refinement.
SMALL = dict(chunk_size=8, outliers=2, min_prefill=64, min_selected_chunks=0)
FULL = dict(budget=10_000, rank=10_000, **SMALL)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=3)


def _run(model, ids, prompt_len, **options):
    enable_shadowkv(model, **options)
    try:
        cache = ShadowKVCache.for_model(model)
        logits = decode_logits(model, ids, prompt_len, cache)
    finally:
        disable_shadowkv(model)
    return logits, cache


def _assert_sparse(cache, layers):
    c = cache.counters
    assert c["compressed_layers"] == layers and c["sparse_steps"] > 0 and c["selected_chunks"] > 0
    assert c["dense_prefill"] == 0 and c["dense_steps"] == 0


@pytest.mark.slow
def test_full_rank_full_budget_matches_dynamic_cache(model):
    """Compression turned off (rank = h*d, every chunk selected): same logits and greedy tokens."""
    ids = torch.randint(0, 97, (1, 166))
    ref = decode_logits(model, ids, 136, DynamicCache(config=model.config))
    out, cache = _run(model, ids, 136, **FULL)
    _assert_sparse(cache, 3)
    assert cache.counters["sparse_steps"] == 30 * 3
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    enable_shadowkv(model, **FULL)
    try:
        skv = ShadowKVCache.for_model(model)
        tokens = greedy_decode(model, ids[:, :136], 24, skv)["tokens"]
    finally:
        disable_shadowkv(model)
    _assert_sparse(skv, 3)
    assert torch.equal(tokens, greedy_decode(model, ids[:, :136], 24, DynamicCache(config=model.config))["tokens"])
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.slow
def test_sparse_budget_selects_budget_and_tracks_positions(model):
    """Small budget and rank: k chunks per head per step, logical length and positions stay right."""
    ids = torch.randint(0, 97, (2, 176))
    steps = 40
    out, cache = _run(model, ids, 136, budget=24, rank=8, **SMALL)
    _assert_sparse(cache, 3)
    heads, k = 2, 24 // 8
    assert cache.counters["selected_chunks"] == 3 * steps * 2 * heads * k
    assert cache.get_seq_length() == 176
    layer = cache.layers[0]
    assert layer.tail_k.shape[2] == 176 - layer.context and layer.select == k
    assert (out - decode_logits(model, ids, 136, DynamicCache(config=model.config))).abs().max() > 1e-4


@pytest.mark.slow
def test_multi_token_append_after_prefill(model):
    """Several tokens at once after prefill (q_len > 1) stay causal among themselves."""
    ids = torch.randint(0, 97, (1, 150))
    ref = model(ids).logits
    enable_shadowkv(model, **FULL)
    try:
        cache = ShadowKVCache.for_model(model)
        out = decode_logits(model, ids[:, :136], 136, cache)
        with torch.no_grad():
            out = model(input_ids=ids[:, 136:], use_cache=True, **{compat.cache_forward_kwarg(model): cache}).logits
    finally:
        disable_shadowkv(model)
    _assert_sparse(cache, 3)
    torch.testing.assert_close(out, ref[:, 136:], atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_offload_path_equals_on_device_path(model):
    """Values gathered chunk-wise from (pinned) CPU memory == gathered token-wise on the device."""
    ids = torch.randint(0, 97, (2, 156))
    off, c_off = _run(model, ids, 136, budget=16, rank=12, offload_values=True, **SMALL)
    dev, c_dev = _run(model, ids, 136, budget=16, rank=12, offload_values=False, **SMALL)
    _assert_sparse(c_off, 3)
    assert c_off.stats()["host_bytes"] > 0 and c_dev.stats()["host_bytes"] == 0
    torch.testing.assert_close(off, dev, atol=0, rtol=0)


@pytest.mark.slow
def test_short_prompt_falls_back_to_dense_and_is_counted(model):
    ids = torch.randint(0, 97, (1, 50))
    out, cache = _run(model, ids, 40, **FULL)
    assert cache.counters["dense_prefill"] == 3 and cache.counters["sparse_steps"] == 0
    torch.testing.assert_close(out, decode_logits(model, ids, 40, DynamicCache(config=model.config)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scaling", [1.0, 1.3])
def test_unrope_then_rope_is_identity(model, scaling):
    rotary = model.model.rotary_emb
    x = torch.randn(2, 3, 57, 16)
    pos = torch.randint(0, 4000, (2, 57))
    cos, sin = rotary(x, pos)
    # Our per-(batch, head, token) cos/sin equal the model's own [batch, seq] ones.
    mine = rope_cos_sin(rotary, pos[:, None].expand(2, 3, 57), x.dtype)
    torch.testing.assert_close(mine[0], cos[:, None].expand(2, 3, 57, 16), atol=0, rtol=0)
    torch.testing.assert_close(mine[1], sin[:, None].expand(2, 3, 57, 16), atol=0, rtol=0)
    cos, sin = cos[:, None] * scaling, sin[:, None] * scaling
    torch.testing.assert_close(apply_rope(invert_rope(x, cos, sin), cos, sin), x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(invert_rope(apply_rope(x, cos, sin), cos, sin), x, atol=1e-5, rtol=1e-5)
    assert (apply_rope(x, cos, sin) - x).abs().max() > 0.1


def test_svd_full_rank_reproduces_keys_and_low_rank_is_optimal():
    keys = torch.randn(2, 4, 90, 16)
    u, sv = low_rank_keys(keys, rank=64)
    assert u.shape == (2, 90, 64) and sv.shape == (2, 4, 64, 16)
    all_tokens = torch.arange(90).expand(2, 4, 90)
    assert (rebuild_keys(u, sv, all_tokens) - keys).abs().max() < 1e-5
    u8, sv8 = low_rank_keys(keys, rank=8)
    err8 = torch.linalg.matrix_norm(rebuild_keys(u8, sv8, all_tokens).permute(0, 2, 1, 3).reshape(2, 90, 64)
                                    - keys.permute(0, 2, 1, 3).reshape(2, 90, 64))
    s = torch.linalg.svdvals(keys.permute(0, 2, 1, 3).reshape(2, 90, 64))
    torch.testing.assert_close(err8, s[:, 8:].norm(dim=-1), atol=1e-4, rtol=1e-4)  # Eckart-Young
    tokens = torch.randint(0, 90, (2, 4, 7))
    picked = rebuild_keys(u, sv, tokens)
    torch.testing.assert_close(picked, torch.stack([torch.stack([keys[b, h, tokens[b, h]] for h in range(4)]) for b in range(2)]),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("m, transposed", [(2, False), (1, False), (1, True), (3, True)])
def test_chunk_selection_equals_brute_force(m, transposed):
    # One query token is every decode step; a transposed query is the layout attention hands over.
    b, h, g, d, c, k = 2, 2, 3, 16, 20, 5
    query, landmarks = torch.randn(b, h * g, m, d), torch.randn(b, h, c, d)
    if transposed:
        query = query.transpose(1, 2).contiguous().transpose(1, 2)
    got = select_chunks(query, landmarks, k, scaling=d**-0.5)
    for bi in range(b):
        for hi in range(h):
            best = torch.full((c,), -1.0)
            for gi in range(g):
                qh = query[bi, hi * g + gi]
                probs = torch.softmax(qh @ landmarks[bi, hi].T * d**-0.5, dim=-1).sum(0)
                best = torch.maximum(best, probs)
            assert set(got[bi, hi].tolist()) == set(best.topk(k).indices.tolist())
    assert chunk_tokens(torch.tensor([[3, 0]]), 4).tolist() == [[12, 13, 14, 15, 0, 1, 2, 3]]
    # Stored padded (a multiple of 8 rows, zeros after the real ones), the count keeps the padding out of the
    # softmax: the same chunks as unpadded, never a padded row.
    padded = pad_landmarks(landmarks)
    assert padded.shape[2] == 24 and torch.equal(padded[:, :, :c], landmarks)
    same = select_chunks(query, padded, k, scaling=d**-0.5, count=c)
    assert torch.equal(same.sort(-1).values, got.sort(-1).values)
    assert (select_chunks(query, padded, c, scaling=d**-0.5, count=c) < c).all()


@pytest.mark.slow
def test_outliers_are_the_least_coherent_chunks(model):
    """Outlier chunks = lowest min-cosine(key, chunk mean) per head, stored exactly; the rest get landmarks."""
    ids = torch.randint(0, 97, (1, 136))
    dense = DynamicCache(config=model.config)
    decode_logits(model, ids, 136, dense)
    _, cache = _run(model, ids, 136, budget=16, rank=8, **SMALL)
    layer, keys = cache.layers[1], dense.layers[1].keys
    chunks = keys[:, :, : layer.context].reshape(1, 2, layer.num_chunks, 8, 16)
    mean = chunks.mean(3, keepdim=True)
    agreement = torch.nn.functional.cosine_similarity(chunks, mean, dim=-1).amin(-1)
    for head in range(2):
        worst = agreement[0, head].topk(2, largest=False).indices.sort().values
        assert set(layer.landmark_chunk[0, head].tolist()) == set(range(layer.num_chunks)) - set(worst.tolist())
        torch.testing.assert_close(layer.outlier_k[0, head], chunks[0, head, worst].reshape(16, 16))
        real = layer.landmarks[0, head, : layer.num_landmarks]
        torch.testing.assert_close(real, mean[0, head, layer.landmark_chunk[0, head], 0])
        assert layer.landmarks.shape[2] % 8 == 0 and not layer.landmarks[0, head, layer.num_landmarks:].any()


@pytest.mark.slow
def test_exact_keys_with_every_chunk_selected_matches_dynamic_cache(model):
    """exact_keys (diagnosis switch): at a low rank the keys are not rebuilt from the SVD, so with every
    chunk selected the cache is the full cache; without the switch the same rank changes the logits."""
    ids = torch.randint(0, 97, (1, 166))
    ref = decode_logits(model, ids, 136, DynamicCache(config=model.config))
    exact, cache = _run(model, ids, 136, budget=10_000, rank=2, exact_keys=True, **SMALL)
    _assert_sparse(cache, 3)
    assert cache.layers[0].u is None and cache.layers[0].exact_k.shape[2] == cache.layers[0].context
    torch.testing.assert_close(exact, ref, atol=2e-5, rtol=1e-5)
    low_rank, _ = _run(model, ids, 136, budget=10_000, rank=2, **SMALL)
    assert (low_rank - ref).abs().max() > 1e-3


@pytest.mark.slow
def test_selection_log_records_each_sparse_step(model):
    """log_selection keeps every decode step's chosen chunk ids per layer, and the needle recall reads them."""
    from neutrain.eval.kv.diagnose import needle_chunk_recall

    ids = torch.randint(0, 97, (1, 146))
    _, cache = _run(model, ids, 136, budget=24, rank=8, log_selection=True, **SMALL)
    layer = cache.layers[0]
    assert len(layer.selection_log) == 10 and layer.selection_log[0].shape == (1, 2, 3)
    chosen = layer.selection_log[0][0, 0, 0].item()
    recall = needle_chunk_recall(cache, [chosen * 8 + 1])
    assert len(recall["selected"]) == 3 and recall["selected"][0] > 0
    missed = sorted(set(range(layer.num_chunks)) - {c for step in layer.selection_log for c in step.flatten().tolist()}
                    - set(layer.outlier_ids.flatten().tolist()))
    if missed:  # a chunk no head ever selected nor kept exact: recall 0 there
        assert needle_chunk_recall(cache, [missed[0] * 8])["covered"][0] == 0.0
    _, quiet = _run(model, ids, 136, budget=24, rank=8, **SMALL)
    assert quiet.layers[0].selection_log == []


@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 2])
def test_device_value_rows_equal_the_offloaded_path(model, rows):
    """A batch whose last ``rows`` rows keep their values on the device decodes exactly as the all-offloaded one."""
    ids = torch.randint(0, 97, (2, 156))
    off, c_off = _run(model, ids, 136, budget=16, rank=12, offload_values=True, **SMALL)
    mixed, c_mix = _run(model, ids, 136, budget=16, rank=12, offload_values=True, device_value_rows=rows, **SMALL)
    _assert_sparse(c_mix, 3)
    host, full_host = c_mix.stats()["host_bytes"], c_off.stats()["host_bytes"]
    assert host == full_host * (2 - rows) // 2  # the device rows' values left the host store
    assert c_mix.stats()["device_bytes"] > c_off.stats()["device_bytes"]
    torch.testing.assert_close(mixed, off, atol=0, rtol=0)


def test_attention_takes_dropout_before_scaling_as_transformers_does():
    """Wrappers (kvpress patches every registered attention) pass ``dropout`` positionally, as sixth argument."""
    import inspect

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from neutrain.eval.kv.shadowkv import shadowkv_attention

    ours = list(inspect.signature(shadowkv_attention).parameters)[:7]
    assert ours == list(inspect.signature(sdpa_attention_forward).parameters)[:7]


@pytest.mark.slow
def test_a_small_budget_is_spent_in_finer_chunks(model):
    """min_selected_chunks (default 8): a 16-token budget is 8 chunks of 2, not 2 chunks of 8; the outliers and the
    local window keep their tokens. The result is exactly ShadowKV configured with chunks of 2 by hand."""
    ids = torch.randint(0, 97, (2, 146))
    paper = dict(SMALL, min_selected_chunks=8)
    refined, cache = _run(model, ids, 136, budget=16, rank=8, **paper)
    _assert_sparse(cache, 3)
    layer = cache.layers[0]
    assert (layer.chunk_size, layer.outlier_ids.shape[-1], layer.select) == (2, 8, 8)
    assert layer.context == 136 - 32 and layer.num_chunks == 52  # local window: 4 chunks of 8 = 32 tokens
    assert layer.outlier_k.shape[2] == 16 and cache.counters["refined_chunk_layers"] == 3
    assert cache.counters["selected_chunks"] == 3 * 10 * 2 * 2 * 8  # layers x steps x batch x heads x 8
    by_hand, manual = _run(model, ids, 136, budget=16, rank=8, chunk_size=2, outliers=8, local_chunks=16,
                           min_prefill=64, min_selected_chunks=0)
    assert manual.counters["refined_chunk_layers"] == 0
    torch.testing.assert_close(refined, by_hand, atol=0, rtol=0)
    literal, _ = _run(model, ids, 136, budget=16, rank=8, **SMALL)  # 2 chunks of 8: another selection
    assert (literal - refined).abs().max() > 1e-4
    # 1.56% of 4,096 tokens (64) is 8 chunks of 8: kept; of 300 tokens (5): chunks of 2, the floor (a chunk
    # of 1 would make the landmarks the keys); a configured chunk of 1 stays 1.
    fraction = ShadowKVCache(model.config, budget=0.0156).layers[0]
    assert fraction.geometry(4096) == (8, 48, 32) and fraction.geometry(300) == (2, 192, 32)
    assert ShadowKVCache(model.config, budget=5, chunk_size=1).layers[0].geometry(300)[0] == 1


@pytest.mark.slow
@pytest.mark.parametrize("values", ["offloaded", "mixed_rows", "mixed_rows_store_reads"])
def test_fused_decode_gives_the_unfused_logits(values):
    """fused_decode: the one-token steps through the Triton kernel (the interpreter here) decode the unfused path's
    logits, the tail in its fixed-capacity buffer growing past its free slots (2) on the way; with
    fused_store_reads the kernel reads the values from the host rows' and the device rows' stores."""
    from neutrain.kernels import shadowkv_fused_decode as kernels

    model = tiny_llama(layers=2, hidden=128)  # head dim 32: the kernel's tl.dot needs halves of 16 channels
    ids = torch.randint(0, 97, (2, 140))
    opts = dict(budget=24, rank=8, device_value_rows=1 if values.startswith("mixed_rows") else 0, **SMALL)
    ref, _ = _run(model, ids, 136, **opts)
    before = kernels.COUNTERS["shadowkv_fused_decode"]
    out, cache = _run(model, ids, 136, fused_decode=True, tail_capacity=2,
                      fused_store_reads=values.endswith("store_reads"), **opts)
    _assert_sparse(cache, 2)
    assert cache.counters["fused_steps"] == cache.counters["sparse_steps"] == 2 * 4
    assert kernels.COUNTERS["shadowkv_fused_decode"] == before + 2 * 4
    layer = cache.layers[0]
    assert int(layer.tail_len) == layer.tail_count == layer.tail_k.shape[2] == 140 - layer.context
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_fused_decode_steps_launch_on_the_same_tensors(model, monkeypatch):
    """What a CUDA graph of the step needs: while the tail buffer has free slots, every fused step of a layer
    launches the kernel with the same shapes, and on the same storage for the layer's state (factors, outliers,
    tail buffers and length, positions; the query, chunk ids and gathered values are the step's own), the tail's
    length moving on the device only."""
    from neutrain.kernels import shadowkv_fused_decode as kernels

    launches = []
    real = kernels.shadowkv_fused_decode
    state = (1, 2, 5, 6, 7, 8, 9, 10)  # u, sv, outlier_k, outlier_v, tail_k, tail_v, tail_len, pos0

    def spy(*args, **kwargs):
        launches.append([tuple(a.shape) for a in args if torch.is_tensor(a)] + [args[i].data_ptr() for i in state])
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "shadowkv_fused_decode", spy)
    wide = tiny_llama(layers=1, hidden=128)  # head dim 32
    ids = torch.randint(0, 97, (1, 140))
    _, cache = _run(wide, ids, 136, budget=24, rank=8, fused_decode=True, tail_capacity=8, **SMALL)
    assert len(launches) == 4 and all(step == launches[0] for step in launches[1:])
    assert int(cache.layers[0].tail_len) == 140 - cache.layers[0].context
