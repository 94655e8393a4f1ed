"""How a float's bits split into an entropy-coded symbol and a raw tail.

Each weight becomes two parts (docs/codec.md §8):

* a **symbol** (0..256) that the Huffman stream codes. For bf16 and fp32 it is
  the 8-bit exponent; for lossless fp16 it is the high byte (sign, 5-bit
  exponent, top 2 mantissa bits), whose entropy is low for the same reason;
* a **tail** of ``tail_bits`` raw bits: ``sign << k | kept mantissa``, packed
  LSB-first into bytes (8, 4, 2 or 1 tails per byte for 1, 2, 4, 8 bits; 3 bytes
  per fp32 lossless tail). Sign and mantissa bits are close to uniform, so
  coding them would gain nothing (docs/codec.md §7: 7.97 of 8 bits).

Lossy modes keep ``k`` mantissa bits, rounding to nearest, ties to the bit
pattern whose last kept bit is 0 (IEEE round-half-even; with ``k = 0`` that bit
is the exponent's lowest), with integer arithmetic on the magnitude (not float casts: Triton's CPU interpreter truncates those), carrying
into the exponent; a carry past the largest finite value saturates to the largest
``k``-bit finite value, never Inf. Inf keeps its exponent; NaN becomes
:data:`~neutrain.compress.huffman.NAN_SYMBOL` because with ``k = 0`` no mantissa
bit is left to tell NaN from Inf. The Triton kernels implement the same integer
formulas; the tests compare them bit for bit.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from neutrain.compress.huffman import NAN_SYMBOL

LOSSY_MANTISSA_BITS = (0, 1, 3, 7)
"""Kept mantissa bits a lossy mode may ask for: ``k + 1`` must divide 8 so tails pack into bytes."""

# dtype -> (storage width, exponent bits, mantissa bits, integer view dtype, stable code)
_FLOAT_FORMATS = {
    torch.bfloat16: (16, 8, 7, torch.int16, 1),
    torch.float16: (16, 5, 10, torch.int16, 2),
    torch.float32: (32, 8, 23, torch.int32, 3),
}
DTYPE_CODES = {dtype: spec[4] for dtype, spec in _FLOAT_FORMATS.items()}
DTYPES_BY_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}


@dataclass(frozen=True)
class Layout:
    """Bit layout of one (dtype, kept mantissa bits) pair.

    Attributes:
        dtype: The float dtype.
        width: Storage bits per element (16 or 32).
        exp_bits: Exponent bits.
        mant_bits: Mantissa bits of the dtype.
        kept: Mantissa bits kept (``mant_bits`` when lossless).
        top_byte: True for lossless fp16, whose symbol is the high byte.
    """

    dtype: torch.dtype
    width: int
    exp_bits: int
    mant_bits: int
    kept: int
    top_byte: bool

    @property
    def lossless(self) -> bool:
        return self.kept == self.mant_bits

    @property
    def tail_bits(self) -> int:
        return 8 if self.top_byte else self.kept + 1

    @property
    def mantissa_bits(self) -> int | None:
        """The ``mantissa_bits`` argument that reproduces this layout (None when lossless)."""
        return None if self.lossless else self.kept


def layout_for(dtype: torch.dtype, mantissa_bits: int | None = None) -> Layout:
    """The layout for ``dtype`` keeping ``mantissa_bits`` (None: lossless).

    Example:
        >>> layout_for(torch.bfloat16).tail_bits, layout_for(torch.bfloat16, 3).tail_bits
        (8, 4)
    """
    if dtype not in _FLOAT_FORMATS:
        raise TypeError(f"NeuZip compresses bfloat16, float16 and float32 tensors, not {dtype}")
    width, exp_bits, mant_bits, _, _ = _FLOAT_FORMATS[dtype]
    if mantissa_bits is None or mantissa_bits >= mant_bits:
        kept = mant_bits
    elif mantissa_bits in LOSSY_MANTISSA_BITS:
        kept = int(mantissa_bits)
    else:
        raise ValueError(
            f"mantissa_bits must be None (lossless) or one of {LOSSY_MANTISSA_BITS}, got {mantissa_bits}"
        )
    top_byte = dtype == torch.float16 and kept == mant_bits
    return Layout(dtype, width, exp_bits, mant_bits, kept, top_byte)


def to_bits(t: torch.Tensor) -> torch.Tensor:
    """Flat ``int64`` tensor of the unsigned bit patterns of ``t`` (any strides)."""
    width, _, _, int_dtype, _ = _FLOAT_FORMATS[t.dtype]
    raw = t.contiguous().reshape(-1).view(int_dtype).to(torch.int64)
    return raw & ((1 << width) - 1)


def from_bits(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`to_bits`: unsigned bit patterns back to a flat ``dtype`` tensor."""
    width, _, _, int_dtype, _ = _FLOAT_FORMATS[dtype]
    signed = torch.where(bits >= (1 << (width - 1)), bits - (1 << width), bits)
    return signed.to(int_dtype).view(dtype)


def split(bits: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """Bit patterns -> (symbols, tails), both ``int64``; applies lossy rounding."""
    if layout.top_byte:
        return bits >> 8, bits & 0xFF
    width, mant = layout.width, layout.mant_bits
    sign = bits >> (width - 1)
    mag = bits & ((1 << (width - 1)) - 1)
    drop = mant - layout.kept
    if drop == 0:
        return mag >> mant, (sign << mant) | (mag & ((1 << mant) - 1))
    inf = ((1 << layout.exp_bits) - 1) << mant
    is_nan = mag > inf
    # Round to nearest even on the magnitude; a carry ripples into the exponent.
    lsb = (mag >> drop) & 1
    rounded = ((mag + (1 << (drop - 1)) - 1 + lsb) >> drop) << drop
    rounded = torch.clamp(rounded, max=inf - (1 << drop))  # saturate at the largest k-bit finite value
    rounded = torch.where(mag == inf, mag, rounded)
    symbols = torch.where(is_nan, NAN_SYMBOL, rounded >> mant)
    kept_mant = torch.where(is_nan, 0, (rounded & ((1 << mant) - 1)) >> drop)
    return symbols, (sign << layout.kept) | kept_mant


def merge(symbols: torch.Tensor, tails: torch.Tensor, layout: Layout) -> torch.Tensor:
    """(symbols, tails) -> bit patterns; inverse of :func:`split` up to lossy rounding."""
    if layout.top_byte:
        return (symbols << 8) | tails
    width, mant, kept = layout.width, layout.mant_bits, layout.kept
    sign = (tails >> kept) & 1
    drop = mant - kept
    mag = (symbols << mant) | ((tails & ((1 << kept) - 1)) << drop)
    if drop:
        quiet_nan = (((1 << layout.exp_bits) - 1) << mant) | (1 << (mant - 1))
        mag = torch.where(symbols == NAN_SYMBOL, quiet_nan, mag)
    return (sign << (width - 1)) | mag


def splits_bytewise(layout: Layout, device: torch.device) -> bool:
    """Whether :func:`split_bf16_bytes` / :func:`merge_bf16_bytes` apply: lossless bf16 on a little-endian CPU.

    There a weight's two bytes map straight to (symbol, tail) with ``uint8`` operations, a
    quarter of the memory traffic of the ``int64`` formulas (the CPU training hot path).
    """
    return (layout.dtype == torch.bfloat16 and layout.lossless and device.type == "cpu"
            and sys.byteorder == "little")


def split_bf16_bytes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless bf16 -> (symbols, tails) as flat ``uint8``; equal to :func:`split` of :func:`to_bits`.

    A little-endian bf16 is ``[e0 m6..m0 | s e7..e1]``: the symbol is the exponent
    ``e7..e0``, the tail ``s m6..m0`` (which is also its packed 8-bit tail byte).
    """
    flat = x.reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # a one-element view may keep a stride and still be "contiguous"
        flat = torch.empty_like(flat, memory_format=torch.contiguous_format).copy_(flat)
    pairs = flat.view(torch.uint8).view(-1, 2)
    low, high = pairs[:, 0], pairs[:, 1]
    symbols = (high << 1).bitwise_or_(low >> 7)  # uint8 shifts drop the sign bit
    tails = (high & 0x80).bitwise_or_(low & 0x7F)
    return symbols, tails


def merge_bf16_bytes(symbols: torch.Tensor, tails: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`split_bf16_bytes`, written into the contiguous bf16 tensor ``out``."""
    symbols = symbols.to(torch.uint8)
    pairs = out.view(-1).view(torch.uint8).view(-1, 2)
    pairs[:, 0] = (symbols << 7).bitwise_or_(tails & 0x7F)
    pairs[:, 1] = (tails & 0x80).bitwise_or_(symbols >> 1)
    return out


def tail_nbytes(numel: int, tail_bits: int) -> int:
    """Bytes of the packed tail stream for ``numel`` elements."""
    return (numel * tail_bits + 7) // 8


def tails_capacity(numel: int, tail_bits: int) -> int:
    """Allocated tail bytes: :func:`tail_nbytes` rounded up to whole 32-bit words (zero padding)."""
    return -(-tail_nbytes(numel, tail_bits) // 4) * 4


def pack_tails(tails: torch.Tensor, tail_bits: int) -> torch.Tensor:
    """Pack ``int64`` tails into a ``uint8`` stream (LSB-first below 8 bits, little-endian above)."""
    numel = tails.numel()
    if tail_bits >= 8:
        per = tail_bits // 8
        shifts = torch.arange(per, device=tails.device) * 8
        return ((tails[:, None] >> shifts) & 0xFF).to(torch.uint8).reshape(-1)
    per_byte = 8 // tail_bits
    padded = torch.zeros(-(-numel // per_byte) * per_byte, dtype=torch.int64, device=tails.device)
    padded[:numel] = tails
    shifts = torch.arange(per_byte, device=tails.device) * tail_bits
    return (padded.view(-1, per_byte) << shifts).sum(dim=1).to(torch.uint8)


def unpack_tails(stream: torch.Tensor, tail_bits: int, index: torch.Tensor) -> torch.Tensor:
    """The ``int64`` tails of elements ``index`` (any shape) from a packed ``uint8`` stream."""
    if tail_bits >= 8:
        per = tail_bits // 8
        raw = stream.view(-1, per).index_select(0, index.reshape(-1)).to(torch.int64)
        raw = raw.view(*index.shape, per)
        return (raw << (torch.arange(per, device=stream.device) * 8)).sum(dim=-1)
    per_byte = 8 // tail_bits
    raw = stream.index_select(0, (index // per_byte).reshape(-1)).view(index.shape).to(torch.int64)
    return (raw >> ((index % per_byte) * tail_bits)) & ((1 << tail_bits) - 1)
