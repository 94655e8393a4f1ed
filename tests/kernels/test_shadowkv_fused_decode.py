"""ShadowKV's fused decode: Triton kernel vs the pure-PyTorch reference (interpreter on CPU, bf16 on GPU)."""

import math
from types import SimpleNamespace

import pytest
import torch

from neutrain.eval.kv.shadowkv_math import shadowkv_fused_decode_reference
from neutrain.kernels import shadowkv_fused_decode as kernels


def _inputs(b, h, group, d, rank, cs, k, outliers, cap, tail, rows_pos0, dtype=torch.float32, device="cpu", seed=0):
    """Random ShadowKV state for one layer: a prompt of ``chunks`` chunks, ``k`` of them selected per head."""
    g = torch.Generator().manual_seed(seed)
    chunks = 2 * k + 3
    n = chunks * cs

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)

    ids = torch.stack([torch.randperm(chunks, generator=g)[:k] for _ in range(b * h)]).view(b, h, k).to(device)
    rotary = SimpleNamespace(inv_freq=1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)),
                             attention_scaling=1.1)
    pos0 = torch.randint(0, 50, (b if rows_pos0 else 1, 1), generator=g).to(device)
    return dict(
        query=rnd(b, h * group, d), u=rnd(b, n, rank, scale=1 / math.sqrt(rank)), sv=rnd(b, h, rank, d),
        chunk_ids=ids, values_sel=rnd(b, h, k * cs, d), outlier_k=rnd(b, h, outliers, d),
        outlier_v=rnd(b, h, outliers, d), tail_k=rnd(b, h, cap, d), tail_v=rnd(b, h, cap, d),
        tail_len=None if tail is None else torch.tensor([tail], dtype=torch.int32, device=device),
        pos0=pos0, rotary=rotary, chunk_size=cs, scaling=d**-0.5,
    )


# (batch, kv heads, group, head dim, rank, chunk, selected chunks, outlier tokens, tail capacity, tail length, pos0
# per row): GQA groups of 1-4 (3: a group that pads), head dims 64 and 128, odd chunk counts, a rank that is not a
# multiple of the rank block, more selected tokens than a token block, a tail shorter than its buffer, none at all,
# and longer than a token block (32 on the interpreter).
SHAPES = [
    (2, 2, 2, 64, 24, 4, 3, 5, 20, 13, True),
    (1, 1, 4, 128, 40, 2, 5, 3, 16, None, False),
    (2, 1, 3, 64, 16, 8, 1, 16, 24, 0, True),
    (1, 2, 1, 128, 17, 4, 9, 1, 40, 33, False),
    (1, 2, 2, 64, 24, 8, 20, 4, 16, 9, True),  # 160 selected tokens: three slices of whole 32-token blocks
]


@pytest.mark.parametrize("splits", [1, 2, 3], ids=lambda n: f"slices{n}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}h{}g{}d{}r{}cs{}k{}".format(*s[:7]))
def test_fused_decode_matches_reference(shape, splits):
    """One slice writes the output itself; two and three slices (the first with the outliers, the last with the
    tail, some with no selected token at all) merge their partials through the combine."""
    inputs = _inputs(*shape)
    before = kernels.COUNTERS["shadowkv_fused_decode"]
    out = kernels.shadowkv_fused_decode(**inputs, splits=splits)
    assert kernels.COUNTERS["shadowkv_fused_decode"] == before + 1
    ref = shadowkv_fused_decode_reference(**inputs)
    assert out.shape == ref.shape == inputs["query"].shape
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_fused_decode_depends_on_every_segment():
    """Each segment moves the output: a kernel that skipped one (or read the wrong chunk) could not pass."""
    inputs = _inputs(*SHAPES[0])
    base = kernels.shadowkv_fused_decode(**inputs)
    changed = {
        "outliers": dict(outlier_v=inputs["outlier_v"] + 1),
        "selection": dict(chunk_ids=(inputs["chunk_ids"] + 1) % (2 * 3 + 3)),
        "rope position": dict(pos0=inputs["pos0"] + 1),
        "tail length": dict(tail_len=inputs["tail_len"] - 1),
    }
    for what, change in changed.items():
        moved = kernels.shadowkv_fused_decode(**{**inputs, **change})
        assert (moved - base).abs().max() > 1e-3, what
        torch.testing.assert_close(moved, shadowkv_fused_decode_reference(**{**inputs, **change}), atol=2e-5,
                                   rtol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_fused_decode_bf16_on_gpu_is_within_bf16_of_the_fp32_reference(d, record_property):
    """Llama-3-8B-like proportions (rank 160, chunks of 8, 48 outlier chunks): bf16 against the fp32 reference."""
    inputs = _inputs(4, 8, 4, d, 160, 8, 33, 48 * 8, 128, 97, True, dtype=torch.bfloat16, device="cuda")
    out = kernels.shadowkv_fused_decode(**inputs)
    fp32 = {key: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for key, v in inputs.items()}
    fp32["rotary"] = SimpleNamespace(inv_freq=inputs["rotary"].inv_freq.cuda(), attention_scaling=1.1)
    ref = shadowkv_fused_decode_reference(**fp32)
    err = (out.float() - ref).abs().max().item()
    record_property("max_abs_error_vs_fp32", err)
    assert err < 3e-2


def test_token_splits_fill_the_gpu_and_keep_whole_blocks():
    """The slices cover the selected tokens once, in whole token blocks, at least four blocks each."""
    for tokens, programs, block in [(1024, 168, 32), (1024, 80, 32), (264, 168, 32), (40, 1, 64), (160, 2, 32)]:
        for forced in (None, 1, 2, 3, 5):
            per, n = kernels.token_splits(tokens, programs, block, splits=forced)
            assert per % block == 0 and (n - 1) * per < tokens <= n * per, (tokens, forced, per, n)
            assert n <= (forced or n)
    assert kernels.token_splits(160, 2, 32, splits=3) == (64, 3)


def _stores(inputs, host_rows):
    """The selected values' stores as the cache keeps them: the first ``host_rows`` rows chunk-major
    ([rows, h, chunks, chunk * d], the host layout), the rest token-major ([rows, h, ctx, d], the device layout);
    ``values_sel`` gathered from them, as the unfused path would."""
    b, h, k = inputs["chunk_ids"].shape
    d, cs = inputs["query"].shape[-1], inputs["chunk_size"]
    g = torch.Generator().manual_seed(1)
    store = torch.randn(b, h, inputs["u"].shape[1], d, generator=g)
    host = store[:host_rows].reshape(host_rows, h, -1, cs * d).contiguous() if host_rows else None
    device = store[host_rows:].contiguous() if host_rows < b else None
    tokens = (inputs["chunk_ids"][..., None] * cs + torch.arange(cs)).flatten(-2)
    return (host, device), store.gather(2, tokens[..., None].expand(-1, -1, -1, d))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}h{}g{}d{}r{}cs{}k{}".format(*s[:7]))
def test_fused_decode_reads_the_value_stores(shape):
    """value_stores: the selected values read in the kernel from the host rows' chunk-major store and the device
    rows' token-major one (all host, mixed, all device) = the same values gathered first."""
    inputs = _inputs(*shape)
    b = shape[0]
    for host_rows, splits in zip(sorted({0, b // 2, b}), (2, 1, 3)):
        stores, gathered = _stores(inputs, host_rows)
        out = kernels.shadowkv_fused_decode(**{**inputs, "values_sel": None}, value_stores=stores, splits=splits)
        torch.testing.assert_close(out, shadowkv_fused_decode_reference(**{**inputs, "values_sel": gathered}),
                                   atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(out, shadowkv_fused_decode_reference(**{**inputs, "values_sel": None},
                                                                        value_stores=stores), atol=2e-5, rtol=2e-5)
