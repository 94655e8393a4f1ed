"""MiniCache's decode attention over stores read in place: Triton kernel vs the pure-PyTorch reference
(interpreter on CPU, bf16 at Llama-3-8B head shapes on the GPU), and the reference vs the restore path."""

import pytest
import torch

from neutrain.eval.kv.minicache_attention import Segment, decode_attention_reference, layer_segments
from neutrain.eval.kv.quant import PlainTokenStore, QuantizedTokenStore
from neutrain.kernels import minicache_attention as kernels


def _quantized(b, h, n, d, group, dtype=torch.float32, device="cpu"):
    ks, vs = QuantizedTokenStore("channel", 4, group), QuantizedTokenStore("token", 4, group)
    ks.append(torch.randn(b, h, n, d, dtype=dtype, device=device))
    vs.append(torch.randn(b, h, n, d, dtype=dtype, device=device))
    return ks, vs


def _segments(b, h, d, dtype=torch.float32, device="cpu", n=40, group=8):
    """A quantized segment with per-token factors (some tokens masked), a padded segment with per-row
    lengths, and rows that are a strided view of a larger buffer: every kind of segment the cache builds."""
    ks, vs = _quantized(b, h, n, d, group, dtype, device)
    n = ks.num_quantized  # the codes' tokens (the rest is the store's residual)
    factor_k = torch.rand(b, n, device=device) * 2 + 0.1
    factor_k[:, ::7] = -1.0  # masked: attended in another segment
    factor_v = torch.rand(b, n, device=device) * 2 + 0.1
    quant = Segment(ks.codes, vs.codes, ks.scale, ks.minimum, vs.scale, vs.minimum, key_group=group,
                    value_group=min(group, d), key_token_scale=factor_k, value_token_scale=factor_v)
    padded = Segment(torch.randn(b, h, 11, d, dtype=dtype, device=device), torch.randn(b, h, 11, d, dtype=dtype, device=device),
                     lengths=torch.tensor([11, 3][:b] + [5] * max(0, b - 2), dtype=torch.int32, device=device))
    big = torch.randn(b, h, 30, d, dtype=dtype, device=device)
    strided = Segment(big[:, :, :19], torch.randn(b, h, 19, d, dtype=dtype, device=device))
    return [quant, padded, strided]


@pytest.mark.parametrize("groups,key_group,d", [(1, 8, 32), (3, 32, 32), (2, 16, 64), (2, 64, 64)])
def test_kernel_matches_reference(groups, key_group, d):
    """Key groups shorter than the kernel's token block (ranges gathered per token) and a multiple of it (one
    range row per block); values in 4, 2 and 1 groups of channels."""
    b, h = 2, 2
    segments = _segments(b, h, d, n=max(40, key_group + 9), group=key_group)
    q = torch.randn(b, h * groups, d)
    before = dict(kernels.COUNTERS)
    out = kernels.decode_attention(q, segments, 0.3)
    assert kernels.COUNTERS["segments"] == before["segments"] + 3 and kernels.COUNTERS["calls"] == before["calls"] + 1
    ref = decode_attention_reference(q, segments, 0.3)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    # guard: the masked tokens matter (unmasking them changes the answer)
    segments[0].key_token_scale = segments[0].key_token_scale.abs()
    assert (decode_attention_reference(q, segments, 0.3) - ref).abs().max() > 1e-3


@pytest.mark.parametrize("launch", [
    kernels.DecodeLaunch(fold_scales=False, magic_codes=False),
    kernels.DecodeLaunch(fold_scales=True, magic_codes=False),
    kernels.DecodeLaunch(fold_scales=True, magic_codes=True),
], ids=["dequantize", "folded", "folded-magic"])
@pytest.mark.parametrize("group,d", [(32, 32), (16, 32), (8, 16)], ids=["one-group", "two-channel-groups",
                                                                        "two-token-groups"])
def test_launches_match_reference(launch, group, d):
    """The scales folded into the query and p, and the codes read as 128 + c by an OR (the offset taken back out
    through the scaled query's and p's sums), give the reference's answer: a block inside one group of tokens
    with one range of values a token, a token's channels in two groups, and a block of two groups of tokens.
    fp32: the interpreter's bf16 is not the GPU's (the bf16 case is the GPU test below)."""
    torch.manual_seed(1)
    b, h = 2, 2
    segments = _segments(b, h, d, n=group * 5 + 5, group=group)
    assert kernels.folds(segments[0], 16, d) == (True, True)  # both folds run (16: the interpreter's block)
    q = torch.randn(b, 2 * h, d)
    out = kernels.decode_attention(q, segments, 0.3, launch)
    ref = decode_attention_reference(q, segments, 0.3)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_reference_is_the_restore_path():
    """Attention over a merged + 4-bit layer's segments equals SDPA over what the cache's restore path reads."""
    from neutrain.eval.kv import MiniCache
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=10)
    cache = MiniCache(cfg, start_layer=0, gamma=0.1, quant_bits=4, quant_group=8, merge_every=None)
    b, h, n, d = 2, 2, 37, 16
    for step in range(3):  # a prompt (merged), then two exact decode tokens
        for i in range(2):
            size = n if step == 0 else 1
            cache.update(torch.randn(b, h, size, d), torch.randn(b, h, size, d), i)
    assert cache.merges == 1 and cache.retained_tokens > 0
    q = torch.randn(b, 4, d)
    for layer in cache.layers:
        k, v = layer.pair.keys.read(layer.side), layer.pair.values.read(layer.side)
        expect = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, scale=0.25, enable_gqa=True)[:, :, 0]
        segments = layer_segments(layer)
        assert len(segments) == 4  # quantized direction, its residual, retained rows, this layer's new tokens
        torch.testing.assert_close(decode_attention_reference(q, segments, 0.25), expect, atol=1e-5, rtol=1e-4)


def test_plain_store_appends_in_place():
    store = PlainTokenStore()
    x = torch.randn(1, 2, 5, 4)
    store.append(x)
    buffer = store._buf
    for i in range(3):
        store.append(x[:, :, i : i + 1])
    assert store._buf is not buffer and store._buf.shape[2] == 6 + store.SLACK  # one grow for the decode tokens
    grown = store._buf
    store.append(x[:, :, :1])
    assert store._buf is grown and len(store) == 9 and store.nbytes == 9 * 8 * 4
    torch.testing.assert_close(store.read(), torch.cat([x, x[:, :, :3], x[:, :, :1]], dim=2))


@pytest.mark.gpu
@pytest.mark.parametrize("group", [64, 128])
def test_kernel_matches_reference_bf16_llama_shapes(record_property, group):
    """Llama-3-8B heads (8 KV heads, groups of 4, head dim 128), 4-bit groups of 64 (values: two ranges a token)
    and 128 (the benchmark's: one range a token, so the value scale folds into p), 8K tokens, bf16."""
    torch.manual_seed(0)
    b, h, d = 3, 8, 128
    segments = _segments(b, h, d, torch.bfloat16, "cuda", n=8192, group=group)
    q = torch.randn(b, 4 * h, d, dtype=torch.bfloat16, device="cuda")
    out = kernels.decode_attention(q, segments, d**-0.5).float()
    ref = decode_attention_reference(q.float(), segments, d**-0.5).float()
    err = (out - ref).abs().max().item()
    record_property("max_abs_error", err)
    record_property("max_abs_ref", ref.abs().max().item())
    print(f"minicache decode attention bf16 vs fp32 reference: max abs error {err:.3e} (ref max {ref.abs().max():.3f})")
    assert err < 2e-2
