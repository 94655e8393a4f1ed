"""Code construction: length limit, Kraft equality, prefix-freeness, escapes."""

import numpy as np
import pytest
import torch

from neutrain.compress import huffman


def _kraft(lengths):
    coded = lengths[lengths > 0].astype(np.float64)
    return (2.0**-coded).sum()


@pytest.mark.parametrize("seed", range(5))
def test_package_merge_is_limited_and_complete(seed):
    rng = np.random.default_rng(seed)
    counts = rng.geometric(0.3, size=rng.integers(2, 300)).astype(np.float64) ** 6  # very skewed
    lengths = huffman.package_merge_lengths(counts, max_bits=12)
    assert lengths.max() <= 12 and lengths.min() >= 1
    assert _kraft(lengths) == pytest.approx(1.0)


def test_package_merge_matches_unlimited_huffman_when_limit_is_loose():
    # Unlimited Huffman cost for these counts, computed by merging the two smallest weights.
    counts = np.array([45, 13, 12, 16, 9, 5], dtype=np.float64)
    lengths = huffman.package_merge_lengths(counts, max_bits=12)
    assert float((lengths * counts).sum()) == 224.0  # textbook example: 224 bits


def test_canonical_codes_are_prefix_free_and_lut_decodes_every_code():
    rng = np.random.default_rng(1)
    hist = np.zeros(huffman.NUM_SYMBOLS)
    hist[rng.choice(256, 40, replace=False)] = rng.integers(1, 10**6, 40)
    lengths = huffman.build_code(hist)
    codes = huffman.canonical_codes(lengths)
    lut = huffman.decode_lut(lengths).numpy().astype(np.int64)
    for sym in np.nonzero(lengths)[0]:
        length, code = int(lengths[sym]), int(codes[sym])
        window = code << (huffman.MAX_CODE_BITS - length)
        assert lut[window] & 0x1FF == sym and lut[window] >> 9 == length
    assert _kraft(lengths) == pytest.approx(1.0)


def test_every_symbol_is_encodable_unused_ones_through_the_escape():
    hist = np.zeros(huffman.NUM_SYMBOLS)
    hist[[120, 121, 122]] = [100, 50, 25]
    lengths = huffman.build_code(hist)
    codes, sym_len = huffman.symbol_codes(lengths)
    assert (sym_len > 0).all() and sym_len.max() <= huffman.MAX_SYMBOL_BITS
    esc = huffman.canonical_codes(lengths)[huffman.ESCAPE]
    assert codes[7] == (esc << huffman.LITERAL_BITS) | 7
    table = huffman.encode_table(lengths)
    assert int(table[121]) == int(codes[121]) | int(lengths[121]) << 24


def test_coded_bits_close_to_entropy_on_bf16_exponents():
    x = (torch.randn(1 << 18) * 0.02).bfloat16()
    exps = (x.view(torch.int16).to(torch.int64) >> 7) & 0xFF
    hist = huffman.histogram(exps)
    p = hist[hist > 0] / hist.sum()
    entropy = float(-(p * np.log2(p)).sum())
    bits = huffman.coded_bits(huffman.build_code(hist), hist) / hist.sum()
    assert entropy <= bits <= entropy + 0.08
