"""Length-limited canonical Huffman codes for the exponent stream.

The codec entropy-codes one small symbol per weight (the bf16 exponent byte).
This module turns a histogram of those symbols into a *canonical* prefix code
whose lengths never exceed :data:`MAX_CODE_BITS`, and into the two tables the
encoder and decoder use:

* the encode table, one ``int32`` per symbol: ``code | length << 16``;
* the decode LUT, ``2**MAX_CODE_BITS`` ``int16`` entries indexed by the next
  ``MAX_CODE_BITS`` stream bits: ``symbol | length << 9``.

Why length-limited: a 12-bit limit keeps the decode LUT at 8 KiB, small enough to
stay in L1 on a GPU, and costs about 0.003 bit/symbol over unlimited Huffman on
bf16 exponents (docs/codec.md §7). Why every symbol gets a code: training moves
weights every step; an exponent that was absent when the table was built must
still be encodable, so the table never has to be rebuilt for correctness, only
for size (see ``CompressedTensor.recompress_``).

Lengths come from the package-merge algorithm (Larmore and Hirschberg, 1990),
which gives the optimal code under a length limit.
"""

from __future__ import annotations

import numpy as np
import torch

MAX_CODE_BITS = 12
"""Longest direct code in bits; also the decoder's peek width and LUT index width."""

NUM_SYMBOLS = 257
"""Byte symbols 0..255 plus :data:`NAN_SYMBOL`, the lossy modes' NaN marker."""

NAN_SYMBOL = 256
"""Symbol meaning "NaN" in lossy modes, where too few mantissa bits remain to tell NaN from Inf."""

ESCAPE = 257
"""Code-table entry for "a literal follows": symbols absent from the histogram are
coded as the escape code followed by :data:`LITERAL_BITS` raw bits."""

LITERAL_BITS = 9
"""Width of an escaped literal (covers all :data:`NUM_SYMBOLS` symbols)."""

MAX_SYMBOL_BITS = MAX_CODE_BITS + LITERAL_BITS
"""Longest coded symbol, escape included (21 bits: fits the decoder's refill invariant of 32 bits)."""

_LEN_SHIFT_LUT = 9  # LUT entry: symbol (9 bits) | length << 9; max 12 << 9 | 257 fits int16
_LEN_SHIFT_ENC = 24  # encode entry: code (<= 21 bits) | length << 24

def package_merge_lengths(counts: np.ndarray, max_bits: int = MAX_CODE_BITS) -> np.ndarray:
    """Optimal prefix-code lengths with no length above ``max_bits``.

    Args:
        counts: Non-negative symbol frequencies, one per symbol. Zero counts are
            raised to one so that every symbol receives a code.
        max_bits: Length limit; ``len(counts) <= 2**max_bits`` is required.

    Returns:
        ``uint8`` array of code lengths, each in ``[1, max_bits]``, satisfying the
        Kraft equality.

    Example:
        >>> package_merge_lengths(np.array([10, 1, 1, 1]), max_bits=2).tolist()
        [2, 2, 2, 2]
    """
    weights = np.maximum(np.asarray(counts, dtype=np.float64), 1.0)
    n = weights.size
    if n > (1 << max_bits):
        raise ValueError(f"{n} symbols do not fit a code limited to {max_bits} bits")
    if n == 1:
        return np.ones(1, dtype=np.uint8)
    order = np.argsort(weights, kind="stable")
    leaf_w = weights[order]
    # Each item is (weight, per-symbol count of appearances). Leaves are unit vectors.
    leaf_hist = np.eye(n, dtype=np.int32)
    prev_w, prev_h = leaf_w, leaf_hist
    for _ in range(max_bits - 1):
        # Package: pair adjacent items of the previous level (drop an odd last one).
        pairs = prev_w.size // 2
        pack_w = prev_w[: 2 * pairs : 2] + prev_w[1 : 2 * pairs : 2]
        pack_h = prev_h[: 2 * pairs : 2] + prev_h[1 : 2 * pairs : 2]
        # Merge packages with the leaves, keeping weight order (stable: leaves first on ties).
        all_w = np.concatenate([leaf_w, pack_w])
        all_h = np.concatenate([leaf_hist, pack_h])
        merged = np.argsort(all_w, kind="stable")
        prev_w, prev_h = all_w[merged], all_h[merged]
    chosen = prev_h[: 2 * n - 2].sum(axis=0)
    lengths = np.empty(n, dtype=np.uint8)
    lengths[order] = chosen
    return lengths


def build_code(hist: np.ndarray) -> np.ndarray:
    """Code lengths for a symbol histogram: symbols seen get direct codes, the rest escape.

    Args:
        hist: Counts of the :data:`NUM_SYMBOLS` symbols.

    Returns:
        ``uint8[NUM_SYMBOLS + 1]``: the length of each symbol's direct code (0 means
        "coded through the escape") and, at index :data:`ESCAPE`, the escape's length.

    Why escapes rather than a 12-bit code for each of the ~227 unused exponents:
    reserving those codes takes about 5.5 % of the code space, which costs about
    0.07 bit/weight on bf16 exponents; one escape code costs about 0.001.

    Example:
        >>> lengths = build_code(np.bincount([3, 3, 3, 7], minlength=NUM_SYMBOLS))
        >>> [int(lengths[i]) for i in (3, 7, ESCAPE, 5)]
        [1, 2, 2, 0]
    """
    hist = np.asarray(hist, dtype=np.float64)
    used = np.nonzero(hist)[0]
    alphabet = np.append(used, ESCAPE)
    lengths = np.zeros(NUM_SYMBOLS + 1, dtype=np.uint8)
    lengths[alphabet] = package_merge_lengths(np.append(hist[used], 1.0))
    return lengths


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical code values for the non-zero lengths (shorter codes first, then by symbol).

    Example:
        >>> canonical_codes(np.array([1, 0, 2, 2])).tolist()
        [0, 0, 2, 3]
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    codes = np.zeros(lengths.size, dtype=np.int64)
    coded = np.nonzero(lengths)[0]
    order = coded[np.lexsort((coded, lengths[coded]))]
    code, prev_len = -1, 0
    for sym in order.tolist():
        length = int(lengths[sym])
        code = (code + 1) << (length - prev_len)
        codes[sym] = code
        prev_len = length
    return codes


def symbol_codes(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-symbol (code, length) with escapes expanded: ``escape_code << 9 | symbol``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    codes = canonical_codes(lengths)
    sym_len = lengths[:NUM_SYMBOLS].copy()
    sym_code = codes[:NUM_SYMBOLS].copy()
    escaped = sym_len == 0
    symbols = np.arange(NUM_SYMBOLS, dtype=np.int64)
    sym_code[escaped] = (codes[ESCAPE] << LITERAL_BITS) | symbols[escaped]
    sym_len[escaped] = lengths[ESCAPE] + LITERAL_BITS
    return sym_code, sym_len


def encode_table(lengths: np.ndarray) -> torch.Tensor:
    """``int32[NUM_SYMBOLS]`` with ``code | length << 24`` per symbol (escapes expanded)."""
    sym_code, sym_len = symbol_codes(lengths)
    return torch.from_numpy((sym_code | (sym_len << _LEN_SHIFT_ENC)).astype(np.int32))


def decode_lut(lengths: np.ndarray) -> torch.Tensor:
    """``int16[2**MAX_CODE_BITS]``: for each 12-bit window, ``symbol | length << 9``.

    The symbol may be :data:`ESCAPE`; the decoder then reads a 9-bit literal.
    """
    codes = canonical_codes(lengths)
    lut = np.zeros(1 << MAX_CODE_BITS, dtype=np.int16)
    for sym in np.nonzero(lengths)[0].tolist():
        length = int(lengths[sym])
        lo = int(codes[sym]) << (MAX_CODE_BITS - length)
        hi = (int(codes[sym]) + 1) << (MAX_CODE_BITS - length)
        lut[lo:hi] = sym | (length << _LEN_SHIFT_LUT)
    return torch.from_numpy(lut)


def histogram(symbols: torch.Tensor) -> np.ndarray:
    """Host-side histogram of a symbol tensor (the one host read in code construction)."""
    return torch.bincount(symbols.reshape(-1).to(torch.int64), minlength=NUM_SYMBOLS).cpu().numpy()


def coded_bits(lengths: np.ndarray, hist: np.ndarray) -> float:
    """Total exponent-stream bits of a histogram under a code, escapes included."""
    _, sym_len = symbol_codes(lengths)
    return float((sym_len.astype(np.float64) * np.asarray(hist, dtype=np.float64)).sum())
