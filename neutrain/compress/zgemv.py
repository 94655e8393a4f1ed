"""``ZgemvWeight``: a lossless bf16 matrix in 12 bits a weight that a GEMV decodes in registers.

NeuZip's training format codes the exponent with a Huffman stream (about 10.8 bits a weight), which a
decoder walks serially: at batch-1 decode, where a step is bound by the bytes read, the matrix had to be
decoded to bf16 first and then read again. This layout trades about 1.2 bits a weight for a fixed-length
code that :func:`neutrain.kernels.zgemv.zgemv` turns into bf16 bit patterns with a few integer
operations per pair of weights, so the weight is read once, at 0.75 of the bf16 bytes.

A bf16 pattern is ``s | h (7 bits) | low byte (exponent's last bit and 7 mantissa bits)``. Per weight:

* the **low byte**, raw (8 bits);
* a **4-bit code**: the sign and ``c`` in 0..7. A row keeps a base ``hb`` (1..120) chosen from its
  histogram of ``h`` to cover the most weights: ``c = h - hb + 1`` for ``h`` in ``hb..hb+6`` (14 exponents,
  trained weights' bulk; ``h = 127``, inf and NaN, is never in it). ``c = 0`` with a zero low byte is
  ``±0`` (signed zeros cost nothing); every other weight is an **escape**: ``c = 0``, low byte 0, sign 0, so
  the product reads +0 there, and its exact pattern goes to a list sorted by row (``esc_ptr``, CSR),
  added by the kernel as a sparse correction. Real weights escape at about 3 to 5 in 10,000.

The GEMV never adds the base per weight: it builds ``w' = s | c | low byte`` (exponent ``2c + e0``, a tiny
normal number; 0 for ``c = 0``, which is why escapes read zero), multiplies by ``x * 2**X_SHIFT`` and scales
each row's sum by ``2**(2 hb - 2 - X_SHIFT)`` at the end. Products are the same real numbers as
``x * w``, so exact in fp32 while ``|x| < 2**(128 - X_SHIFT)`` and not below ``2**-(X_SHIFT + 1)`` (where
they underflow: negligible terms).

Storage, for ``K`` padded to ``Kp`` (a multiple of 8; padding is +0) and ``G = Kp / 8`` groups a row:
column ``j = p * Kp / 4 + 2 g + lane`` is pair ``p`` (0..3), group ``g``, lane ``lane`` (0: low half of a
32-bit word, 1: high half), so one ``x`` word of two bf16 columns feeds a decoded pair, and each quarter's
columns are contiguous. ``codes[n, g]`` (int32) holds a group's 8 codes so that ``rotl(word, 4 p) &
0x87008700`` puts pair ``p``'s signs at bits 15 and 31 and its ``c`` at bits 8..10 and 24..26; ``raw[q, n,
g]`` holds pairs ``2q`` and ``2q + 1``'s low bytes so that ``(word >> 8 (p % 2)) & 0x00FF00FF`` is pair
``p``'s. One OR later the pair is two bf16 patterns in one register; or (the kernel's default) one byte
permute per lane puts each pattern into the high half of its own fp32.
"""

from __future__ import annotations

import math

import torch

from neutrain.compress.tensor import CompressedTensor, compress

#: ``x`` is scaled by this power of two inside the kernel, so that products with the tiny ``w'`` are normal.
X_SHIFT = 80
#: Exponent-high values (``h = exponent >> 1``) a row's window covers, and the largest base (``h = 127``,
#: the exponents 254 and 255 of huge values, inf and NaN, always escapes).
WINDOW, MAX_BASE = 7, 126 - 6
_GROUP = 8


def _code_positions(p: int, lane: int) -> tuple[int, int]:
    """Bit positions (of ``c``'s lowest bit, of the sign) of pair ``p``'s ``lane`` in a group's code word."""
    c_target, s_target = (8, 15) if lane == 0 else (24, 31)
    return (c_target - 4 * p) % 32, (s_target - 4 * p) % 32


def _bits(w: torch.Tensor) -> torch.Tensor:
    return w.view(torch.int16).to(torch.int32) & 0xFFFF


def _to_int32(t: torch.Tensor) -> torch.Tensor:
    """An int64 tensor of 32-bit patterns as int32 (two's complement)."""
    return torch.where(t >= 1 << 31, t - (1 << 32), t).to(torch.int32)


def choose_bases(h: torch.Tensor, nonzero: torch.Tensor) -> torch.Tensor:
    """Per row, the base ``hb`` in ``1..MAX_BASE`` whose window ``hb..hb+6`` holds the most non-zero weights."""
    n = h.shape[0]
    counted = torch.where(nonzero, h, 0).long()
    hist = torch.zeros(n, 128, dtype=torch.int64, device=h.device)
    hist.scatter_add_(1, counted, torch.ones_like(counted))
    hist[:, 0] = 0  # zeros (counted there) are free; subnormals escape anyway
    sums = torch.nn.functional.pad(hist.cumsum(1), (1, 0))
    window = sums[:, 1 + WINDOW : MAX_BASE + 1 + WINDOW] - sums[:, 1 : MAX_BASE + 1]  # base 1..MAX_BASE
    return window.argmax(1) + 1


def _encode_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, raw, base, escape mask [n, K])`` of some rows of a bf16 matrix."""
    n, k = w.shape
    kp = -(-max(k, 1) // _GROUP) * _GROUP
    g = kp // _GROUP
    bits = torch.nn.functional.pad(_bits(w.contiguous()), (0, kp - k))  # padding: +0
    sign, h, low = bits >> 15, (bits >> 8) & 0x7F, bits & 0xFF
    zero = (bits & 0x7FFF) == 0
    base = choose_bases(h, ~zero)
    inside = (h >= base[:, None]) & (h < base[:, None] + WINDOW)
    escape = ~inside & ~zero
    c = torch.where(inside, h - base[:, None] + 1, 0)
    sign = torch.where(escape, 0, sign)
    low = torch.where(escape, 0, low)
    # [n, Kp] -> [n, pair, group, lane]: column p * Kp/4 + 2 g + lane
    c, sign, low = (t.view(n, 4, g, 2).long() for t in (c, sign, low))
    codes = torch.zeros(n, g, dtype=torch.int64, device=w.device)
    raw = torch.zeros(2, n, g, dtype=torch.int64, device=w.device)
    for p in range(4):
        for lane in range(2):
            c_at, s_at = _code_positions(p, lane)
            codes |= (c[:, p, :, lane] << c_at) | (sign[:, p, :, lane] << s_at)
            raw[p // 2] |= low[:, p, :, lane] << (8 * (p % 2) + 16 * lane)
    return _to_int32(codes), _to_int32(raw), base.to(torch.uint8), escape[:, :k]


def _decode_rows(codes: torch.Tensor, raw: torch.Tensor, base: torch.Tensor, k: int) -> torch.Tensor:
    """The int16 patterns of some rows, escapes read as +0."""
    n, g = codes.shape
    codes, raw = codes.long() & 0xFFFFFFFF, raw.long() & 0xFFFFFFFF
    c = torch.empty(n, 4, g, 2, dtype=torch.int64, device=codes.device)
    sign, low = torch.empty_like(c), torch.empty_like(c)
    for p in range(4):
        for lane in range(2):
            c_at, s_at = _code_positions(p, lane)
            c[:, p, :, lane] = (codes >> c_at) & 7
            sign[:, p, :, lane] = (codes >> s_at) & 1
            low[:, p, :, lane] = (raw[p // 2] >> (8 * (p % 2) + 16 * lane)) & 0xFF
    c, sign, low = (t.view(n, 8 * g)[:, :k] for t in (c, sign, low))
    h = torch.where(c > 0, base.long()[:, None] + c - 1, 0)
    return _to_int32((sign << 15) | (h << 8) | low).to(torch.int16)


_SHIFTS: dict[torch.device, tuple[torch.Tensor, ...]] = {}


def _field_shifts(device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per (pair, lane) field: the code's and the sign's bit positions, the raw word and its shift. Made once per
    device, so a decode inside a CUDA graph capture copies nothing from the host."""
    shifts = _SHIFTS.get(device)
    if shifts is None:
        fields = [(p, lane, *_code_positions(p, lane)) for p in range(4) for lane in range(2)]
        shifts = _SHIFTS[device] = (
            torch.tensor([f[2] for f in fields], dtype=torch.int32, device=device),
            torch.tensor([f[3] for f in fields], dtype=torch.int32, device=device),
            torch.tensor([f[0] // 2 for f in fields], dtype=torch.int64, device=device),
            torch.tensor([8 * (f[0] % 2) + 16 * f[1] for f in fields], dtype=torch.int32, device=device))
    return shifts


def _decode_block(codes: torch.Tensor, raw: torch.Tensor, base: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The int16 patterns ``[n, Kp]`` of some rows (escapes read as +0), in int32 arithmetic, into ``out`` if given.

    All eight (pair, lane) fields of a group's words at once: ``[n, G, 8]`` int32 temporaries, then one strided
    store into the ``[n, pair, group, lane]`` order of the columns."""
    n, g = codes.shape
    c_at, s_at, raw_of, raw_at = _field_shifts(codes.device)
    words = codes[:, :, None]
    c = (words >> c_at).bitwise_and_(7)
    inside = c > 0
    pattern = c.add_(base.to(torch.int32)[:, None, None] - 1).mul_(inside).bitwise_left_shift_(8)  # h << 8, 0 at c = 0
    del inside
    pattern |= (words >> s_at).bitwise_and_(1).bitwise_left_shift_(15)
    pattern |= (raw.permute(1, 2, 0)[:, :, raw_of] >> raw_at).bitwise_and_(0xFF)
    if out is None:
        out = torch.empty(n, _GROUP * g, dtype=torch.int16, device=codes.device)
    out.view(n, 4, g, 2).permute(0, 2, 1, 3).copy_(pattern.view(n, g, 4, 2))  # int32 -> int16 keeps the low bits
    return out


class ZgemvWeight:
    """A bf16 matrix ``[N, K]`` in the zgemv layout (see the module docstring); :meth:`from_bf16` builds one.

    Example:
        >>> w = (torch.randn(256, 1024) * 0.02).bfloat16()
        >>> zw = ZgemvWeight.from_bf16(w)
        >>> torch.equal(zw.to_bf16().view(torch.int16), w.view(torch.int16))
        True
        >>> 12.0 <= zw.bits_per_weight() < 12.2
        True
    """

    def __init__(self, shape, codes, raw, base, esc_ptr, esc_row, esc_col, esc_val):
        self.shape = torch.Size(shape)
        self.codes, self.raw, self.base = codes, raw, base
        self.esc_ptr, self.esc_row, self.esc_col, self.esc_val = esc_ptr, esc_row, esc_col, esc_val
        # Scratch of the kernel's split-K reduction: slices finished per row block, back to 0 after each call.
        self.counters = torch.zeros(self.shape[0], dtype=torch.int32, device=codes.device)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def groups(self) -> int:
        return self.codes.shape[1]

    @property
    def escapes(self) -> int:
        return self.esc_col.numel()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "raw": self.raw, "base": self.base, "esc_ptr": self.esc_ptr,
                "esc_row": self.esc_row, "esc_col": self.esc_col, "esc_val": self.esc_val}

    def to(self, device) -> "ZgemvWeight":
        return ZgemvWeight(self.shape, **{k: v.to(device) for k, v in self.tensors().items()})

    def clone(self) -> "ZgemvWeight":
        """A copy in new memory (``to`` the same device shares it)."""
        return ZgemvWeight(self.shape, **{k: v.clone() for k, v in self.tensors().items()})

    def nbytes(self) -> int:
        """Bytes held: the codes, the low bytes, the per-row bases, escape pointers and counters, the escapes."""
        return sum(t.numel() * t.element_size() for t in (*self.tensors().values(), self.counters))

    def bits_per_weight(self) -> float:
        return 8 * self.nbytes() / math.prod(self.shape)

    @classmethod
    def from_bf16(cls, w: torch.Tensor, *, chunk_rows: int = 4096) -> "ZgemvWeight":
        """Encode a 2-D bf16 tensor (any device; every bit pattern round-trips through :meth:`to_bf16`),
        ``chunk_rows`` rows at a time (the int64 temporaries of a chunk are about 50 bytes a weight)."""
        if w.dtype != torch.bfloat16 or w.dim() != 2:
            raise ValueError(f"the zgemv layout holds a 2-D bf16 matrix, got {w.dtype} of shape {tuple(w.shape)}")
        n, k = w.shape
        parts = [_encode_rows(w[i : i + chunk_rows]) for i in range(0, n, chunk_rows)] or [_encode_rows(w)]
        codes, raw, base = (torch.cat([p[j] for p in parts], int(j == 1)) for j in range(3))  # raw is [2, n, G]
        escape = torch.cat([p[3] for p in parts])
        rows, cols = escape.nonzero(as_tuple=True)  # row-major: sorted by row, then column
        counts = torch.bincount(rows, minlength=n)
        esc_ptr = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
        esc_val = w[rows, cols].view(torch.int16)
        return cls((n, k), codes, raw, base, esc_ptr, rows.to(torch.int32), cols.to(torch.int32), esc_val.contiguous())

    def to_bf16(self, *, chunk_rows: int = 4096) -> torch.Tensor:
        """The exact bf16 matrix (pure PyTorch, on the layout's device), ``chunk_rows`` rows at a time."""
        n, k = self.shape
        out = torch.empty(n, k, dtype=torch.int16, device=self.device)
        for i in range(0, n, chunk_rows):
            j = min(n, i + chunk_rows)
            out[i:j] = _decode_rows(self.codes[i:j], self.raw[:, i:j], self.base[i:j], k)
        out[self.esc_row.long(), self.esc_col.long()] = self.esc_val
        return out.view(torch.bfloat16)

    def escape_span(self, start: int, stop: int) -> tuple[int, int]:
        """The escapes of rows ``start:stop``: a slice of the escape lists (one host read of ``esc_ptr``)."""
        lo, hi = self.esc_ptr[[start, stop]].tolist()
        return int(lo), int(hi)

    def decode_into(self, out: torch.Tensor, start: int = 0, escapes: tuple[int, int] | None = None,
                    chunk: int = 1 << 22) -> torch.Tensor:
        """Rows ``start : start + out.shape[0]`` as exact bf16 into ``out`` (contiguous ``[rows, K]``).

        ``escapes`` is :meth:`escape_span` of those rows (given, no host read happens here, so a decode can be
        queued without a synchronisation, or captured in a CUDA graph). Pure PyTorch on int32 words, ``chunk``
        weights at a time. Its cost: about 15 elementwise kernels a chunk over ``[rows, K]`` int32 values, so on
        the order of 100 bytes of memory traffic a weight against the 3.5 of one read of the layout and one write
        of the bf16 that a Triton kernel would need (estimated, not measured: about 0.2 s of an H200's bandwidth
        for one prefill of Llama-3-8B's 7 B matrix weights, plus some 20,000 kernel launches); the temporaries
        stay near 12 bytes a chunk weight (48 MiB at the default).
        """
        rows, k = out.shape
        if k != self.shape[1] or out.dtype != torch.bfloat16 or not out.is_contiguous() or out.device != self.device:
            raise ValueError(f"out must be a contiguous bf16 [rows, {self.shape[1]}] on {self.device}, "
                             f"got {out.dtype} {tuple(out.shape)} on {out.device}")
        if escapes is None:
            escapes = self.escape_span(start, start + rows)
        bits = out.view(torch.int16)
        step = max(1, chunk // (_GROUP * max(1, self.groups)))
        for i in range(0, rows, step):
            j = min(rows, i + step)
            target = bits[i:j] if k == _GROUP * self.groups else None
            decoded = _decode_block(self.codes[start + i : start + j], self.raw[:, start + i : start + j],
                                    self.base[start + i : start + j], target)
            if target is None:
                bits[i:j] = decoded[:, :k]
        lo, hi = escapes
        if hi > lo:
            bits[self.esc_row[lo:hi].long() - start, self.esc_col[lo:hi].long()] = self.esc_val[lo:hi]
        return out

    def decode_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` (any shape) as exact bf16: ``index.shape + (K,)`` (embedding lookups of a tied weight)."""
        index = torch.as_tensor(index, device=self.device).long()
        rows, inverse = index.reshape(-1).unique(return_inverse=True)  # sorted
        bits = _decode_block(self.codes[rows], self.raw[:, rows], self.base[rows], None)[:, : self.shape[1]]
        esc_row = self.esc_row.long()
        pick = torch.isin(esc_row, rows)
        at = torch.searchsorted(rows, esc_row[pick])
        bits[at, self.esc_col[pick].long()] = self.esc_val[pick]
        return bits.view(torch.bfloat16)[inverse].reshape(*index.shape, self.shape[1])

    @classmethod
    def from_compressed(cls, ct: CompressedTensor) -> "ZgemvWeight":
        """From NeuZip's training format, through its exact bf16 (lossless or lossy: what it decodes to)."""
        if ct.dtype != torch.bfloat16:
            raise ValueError(f"the zgemv layout holds bf16 weights, the compressed tensor is {ct.dtype}")
        return cls.from_bf16(ct.decompress())

    def to_compressed(self, name: str | None = None) -> CompressedTensor:
        """NeuZip's lossless training format of the same bf16 matrix."""
        return compress(self.to_bf16(), name=name)


def zgemv_reference(x: torch.Tensor, zw: ZgemvWeight) -> torch.Tensor:
    """``x @ W.T`` of ``x [..., K]`` and the layout's exact bf16 ``W``, accumulated in fp32 (float64 for
    float64 ``x``), in ``x``'s dtype: what :func:`neutrain.kernels.zgemv.zgemv` computes.

    Example:
        >>> w = torch.tensor([[1.0, -2.0], [0.5, 0.0]]).bfloat16()
        >>> zgemv_reference(torch.ones(1, 2), ZgemvWeight.from_bf16(w)).tolist()
        [[-1.0, 0.5]]
    """
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.to(acc) @ zw.to_bf16().to(acc).T).to(x.dtype)
