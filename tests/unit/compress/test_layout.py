"""Bit splitting and lossy rounding against an independent float64 oracle."""

import math

import pytest
import torch

from neutrain.compress.huffman import NAN_SYMBOL
from neutrain.compress.layout import (from_bits, layout_for, merge, pack_tails, split, tail_nbytes, to_bits,
                                      unpack_tails)

ALL_BF16 = torch.arange(1 << 16, dtype=torch.int64)


def _round_oracle(x: torch.Tensor, kept: int, max_finite_exp: int, min_exp: int, mant_bits: int) -> torch.Tensor:
    """Round float64 values to ``kept`` mantissa bits (RNE), saturating; independent of layout.split.

    Ties go to the neighbour whose last kept bit is 0. With ``kept = 0`` that bit
    is the exponent's lowest bit (``2**e`` vs ``2**(e+1)``), which plain
    ``torch.round`` does not know about, so that case is resolved explicitly.
    """
    finite = torch.isfinite(x) & (x != 0)
    mag = x.abs()
    exp = torch.floor(torch.log2(torch.where(finite, mag, torch.ones_like(mag))))
    exp = torch.clamp(exp, min=min_exp)
    quantum = torch.exp2(exp - kept)
    rounded = torch.round(mag / quantum) * quantum  # torch.round is half-to-even
    if kept == 0:
        low = torch.floor(mag / quantum) * quantum
        tie = (mag / quantum - torch.floor(mag / quantum)) == 0.5
        biased = torch.log2(torch.where(low > 0, low, torch.ones_like(low))) + (1 - min_exp)
        low_even = (low == 0) | (torch.remainder(biased, 2) == 0)
        rounded = torch.where(tie, torch.where(low_even, low, low + quantum), rounded)
    largest = (2 - 2.0**-kept) * 2.0**max_finite_exp
    rounded = torch.clamp(rounded, max=largest)
    return torch.where(finite, torch.copysign(rounded, x), x)


@pytest.mark.parametrize("kept", [0, 1, 3])
def test_lossy_rounding_matches_float64_oracle_on_all_bf16_patterns(kept):
    layout = layout_for(torch.bfloat16, kept)
    x = from_bits(ALL_BF16, torch.bfloat16)
    got = from_bits(merge(*split(ALL_BF16, layout), layout), torch.bfloat16).double()
    want = _round_oracle(x.double(), kept, max_finite_exp=127, min_exp=-126, mant_bits=7)
    nan = torch.isnan(x)
    assert torch.isnan(got[nan]).all()
    assert torch.equal(got[~nan], want[~nan])


@pytest.mark.parametrize("dtype,kept", [(torch.float16, 1), (torch.float32, 3), (torch.float32, 7)])
def test_lossy_rounding_matches_oracle_other_dtypes(dtype, kept):
    x = torch.randn(20000, dtype=torch.float64).mul(torch.randn(20000).exp2().mul(8)).to(dtype)
    x[:4] = torch.tensor([float("inf"), -float("inf"), float("nan"), torch.finfo(dtype).max])
    layout = layout_for(dtype, kept)
    got = from_bits(merge(*split(to_bits(x), layout), layout), dtype).double()
    info = torch.finfo(dtype)
    want = _round_oracle(x.double(), kept, max_finite_exp=math.floor(math.log2(info.max)),
                         min_exp=round(math.log2(info.tiny)), mant_bits=layout.mant_bits)
    assert torch.isnan(got[2])
    keep = ~torch.isnan(x)
    assert torch.equal(got[keep], want[keep])


def test_nan_symbol_only_in_lossy_modes():
    bits = torch.tensor([0x7FC1, 0xFF81, 0x7F80], dtype=torch.int64)
    assert split(bits, layout_for(torch.bfloat16, 0))[0].tolist() == [NAN_SYMBOL, NAN_SYMBOL, 0xFF]
    assert split(bits, layout_for(torch.bfloat16))[0].tolist() == [0xFF, 0xFF, 0xFF]


@pytest.mark.parametrize("tail_bits", [1, 2, 4, 8, 24])
def test_tail_packing_roundtrip(tail_bits):
    tails = torch.randint(0, 1 << tail_bits, (1001,))
    packed = pack_tails(tails, tail_bits)
    assert packed.dtype == torch.uint8 and packed.numel() == tail_nbytes(1001, tail_bits)
    index = torch.randperm(1001)
    assert torch.equal(unpack_tails(packed, tail_bits, index), tails[index])


def test_invalid_mantissa_bits_and_dtype():
    with pytest.raises(ValueError):
        layout_for(torch.bfloat16, 2)
    with pytest.raises(TypeError):
        layout_for(torch.int8)
    assert layout_for(torch.bfloat16, 7).lossless
