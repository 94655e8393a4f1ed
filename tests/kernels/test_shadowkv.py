"""ShadowKV chunk gather: Triton kernel vs torch reference (interpreter on CPU, pinned host memory on GPU)."""

import pytest
import torch

from neutrain.kernels import shadowkv as kernels


@pytest.mark.parametrize("row", [40, 64])
def test_gather_chunks_matches_reference(row):
    src = torch.randn(2, 3, 9, row)
    ids = torch.randint(0, 9, (2, 3, 4))
    before = kernels.COUNTERS["gather_chunks"]
    out = kernels.gather_chunks(src, ids)
    assert kernels.COUNTERS["gather_chunks"] == before + 1
    assert torch.equal(out, kernels.gather_chunks_reference(src, ids))


@pytest.mark.gpu
def test_gather_chunks_reads_pinned_host_memory():
    src = torch.randn(4, 8, 512, 1024, dtype=torch.bfloat16).pin_memory()
    ids = torch.randint(0, 512, (4, 8, 128), device="cuda")
    out = kernels.gather_chunks(src, ids)
    assert out.is_cuda
    assert torch.equal(out.cpu(), kernels.gather_chunks_reference(src, ids.cpu()))


def _tiny_cuda_llama():
    """A 2-layer GQA Llama on the GPU, random weights (seed 0): 600-token prompts fill its sparse decode."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                   intermediate_size=512, vocab_size=128)
    return transformers.AutoModelForCausalLM.from_config(cfg).cuda().eval()


@pytest.mark.gpu
def test_shadowkv_offload_uses_kernel_and_matches_device_path():
    from neutrain.eval.kv import ShadowKVCache, disable_shadowkv, enable_shadowkv
    from neutrain.eval.loop import greedy_decode

    model = _tiny_cuda_llama()
    ids = torch.randint(0, 128, (2, 600), device="cuda")
    tokens = {}
    for offload, device_rows in ((True, 0), (True, 1), (False, 0)):  # all offloaded, a mixed batch, none
        enable_shadowkv(model, budget=64, rank=32, outliers=4, min_prefill=256, offload_values=offload,
                        device_value_rows=device_rows)
        cache = ShadowKVCache.for_model(model)
        before = kernels.COUNTERS["gather_chunks"]
        tokens[offload, device_rows] = greedy_decode(model, ids, 16, cache)["tokens"]
        disable_shadowkv(model)
        assert cache.counters["sparse_steps"] > 0 and cache.counters["dense_prefill"] == 0
        if offload:
            assert kernels.COUNTERS["gather_chunks"] > before and cache.stats()["host_bytes"] > 0
    assert torch.equal(tokens[True, 0], tokens[False, 0]) and torch.equal(tokens[True, 1], tokens[False, 0])


@pytest.mark.gpu
def test_fused_decode_gives_the_unfused_tokens_on_gpu():
    """fused_decode on the GPU (fp32 model: the kernel's exact-fp32 dots), all rows offloaded and a mixed batch,
    the values gathered first or read by the kernel from pinned host memory and the device rows' store: the
    unfused path's greedy tokens."""
    from neutrain.eval.kv import ShadowKVCache, disable_shadowkv, enable_shadowkv
    from neutrain.eval.loop import greedy_decode
    from neutrain.kernels import shadowkv_fused_decode as fused_kernels

    model = _tiny_cuda_llama()
    ids = torch.randint(0, 128, (2, 600), device="cuda")
    for rows in (0, 1):
        tokens = {}
        for fused, store_reads in ((False, False), (True, False), (True, True)):
            enable_shadowkv(model, budget=64, rank=32, outliers=4, min_prefill=256, device_value_rows=rows,
                            fused_decode=fused, tail_capacity=8, fused_store_reads=store_reads)
            cache = ShadowKVCache.for_model(model)
            before = fused_kernels.COUNTERS["shadowkv_fused_decode"]
            tokens[fused, store_reads] = greedy_decode(model, ids, 16, cache)["tokens"]
            disable_shadowkv(model)
            launched = fused_kernels.COUNTERS["shadowkv_fused_decode"] - before
            assert (launched > 0) == fused and cache.counters["fused_steps"] == launched
            assert (cache.counters["uva_gathers"] > 0) == (not store_reads), (fused, store_reads)
        assert torch.equal(tokens[True, False], tokens[False, False])
        assert torch.equal(tokens[True, True], tokens[False, False])


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused_decode"])
def test_shadowkv_decode_step_records_its_phases(fused):
    """kv_eval's step split: every sparse layer marks its phases in order, the host gather on its side stream."""
    from benchmarks.kv._kv_timing import SHADOWKV_PHASES, shadowkv_step_split
    from neutrain import compat
    from neutrain.eval.kv import ShadowKVCache, disable_shadowkv, enable_shadowkv

    model = _tiny_cuda_llama()
    enable_shadowkv(model, budget=64, rank=32, outliers=4, min_prefill=256, device_value_rows=1, fused_decode=fused)
    try:
        cache = ShadowKVCache.for_model(model)
        with torch.inference_mode():
            model(torch.randint(0, 128, (2, 600), device="cuda"), use_cache=True, **{compat.cache_forward_kwarg(model): cache})
        split = shadowkv_step_split(model, cache, 2)
    finally:
        disable_shadowkv(model)
    assert split["layers"] == 2 and cache.phase_events is None and (cache.counters["fused_steps"] > 0) == fused
    assert all(split[f"{p}_ms"] >= 0 for p in SHADOWKV_PHASES) and split["host_gather_kernel_ms"] > 0
    assert 0 < sum(split[f"{p}_ms"] for p in SHADOWKV_PHASES) < split["step_ms"] and split["rest_ms"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("fused,store_reads", [(False, False), (True, False), (True, True)],
                         ids=["unfused", "fused_decode", "fused_decode_store_reads"])
def test_shadowkv_layer_step_makes_no_host_sync(fused, store_reads):
    """A sparse layer's decode step (the tail append, the selection, the host rows' value gather on its side stream,
    the attention) asks the host for nothing: no ``.item()``, no shape read off device data, so one CUDA graph can
    hold the step. A mixed batch (one row's values on the device) takes both gather paths."""
    from neutrain import compat
    from neutrain.eval.kv import ShadowKVCache, disable_shadowkv, enable_shadowkv

    model = _tiny_cuda_llama()
    enable_shadowkv(model, budget=64, rank=32, outliers=4, min_prefill=256, device_value_rows=1, fused_decode=fused,
                    fused_store_reads=store_reads)
    try:
        cache = ShadowKVCache.for_model(model)
        with torch.inference_mode():
            model(torch.randint(0, 128, (2, 600), device="cuda"), use_cache=True,
                  **{compat.cache_forward_kwarg(model): cache})
            layer, attn = cache.layers[0], model.model.layers[0].self_attn
            assert layer.mode == "sparse"

            def step():
                key, value = torch.randn(2, 2, 1, 32, device="cuda"), torch.randn(2, 2, 1, 32, device="cuda")
                layer.update(key, value)
                return layer.sparse_attention(attn, torch.randn(2, 8, 1, 32, device="cuda"), attn._shadowkv_rotary)

            for _ in range(2):  # warm-up: kernels compiled, the side stream made, the fused path's tail buffers
                step()
            torch.cuda.synchronize()
            fused_before = cache.counters["fused_steps"]
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(3):
                    out = step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
    finally:
        disable_shadowkv(model)
    assert out.shape == (2, 1, 8, 32) and torch.isfinite(out).all()
    assert cache.counters["fused_steps"] - fused_before == (3 if fused else 0)
    if fused:
        assert int(layer.tail_len) == layer.tail_count == layer.tail_k.shape[2]
