"""KIVI-style low-bit storage of KV token streams (arXiv 2402.02750), used by MiniCache.

KIVI quantizes keys per channel (outlier channels keep their own range) and
values per token, in groups of ``group`` tokens; the newest ``< group`` tokens
stay in full precision until a group is complete. Two 4-bit codes are packed in
one byte so that ``nbytes`` measures what a real deployment stores.

Example:
    >>> import torch
    >>> store = QuantizedTokenStore(axis="channel", bits=4, group=4)
    >>> store.append(torch.randn(1, 2, 6, 8))
    >>> store.read().shape, store.num_quantized
    (torch.Size([1, 2, 6, 8]), 4)
"""

from __future__ import annotations

import torch


class PlainTokenStore:
    """A growing ``[batch, heads, tokens, dim]`` tensor (the unquantized counterpart).

    Appends write into spare capacity (``SLACK`` tokens, added when it runs out): a decode step's one
    token then costs one row, not a copy of the whole stream as ``torch.cat`` would (DynamicCache's way).
    """

    SLACK = 256

    def __init__(self):
        self._buf: torch.Tensor | None = None
        self._len = 0

    @property
    def data(self) -> torch.Tensor | None:
        return None if self._buf is None else self._buf[:, :, : self._len]

    def append(self, x: torch.Tensor) -> None:
        n = x.shape[-2]
        if self._buf is None or self._len + n > self._buf.shape[-2]:
            b, h, _, d = x.shape
            # the prompt exactly; slack only once decoding appends (a copy every SLACK steps, not every step)
            size = self._len + n + (self.SLACK if self._len else 0)
            grown = torch.empty(b, h, size, d, dtype=x.dtype, device=x.device)
            if self._len:
                grown[:, :, : self._len] = self._buf[:, :, : self._len]
            self._buf = grown
        self._buf[:, :, self._len : self._len + n] = x
        self._len += n

    def read(self) -> torch.Tensor | None:
        return self.data

    def rows(self, batch_idx: torch.Tensor, token_idx: torch.Tensor) -> torch.Tensor:
        """The rows of the given (batch, token) pairs, [n, h, d]."""
        return self._buf[batch_idx, :, token_idx]

    def token_norms(self, block: int = 4096) -> torch.Tensor:
        """Per (batch, token) norm over heads and dims, [b, tokens] fp32."""
        return torch.linalg.vector_norm(self.data, dim=(1, 3), dtype=torch.float32)

    def __len__(self) -> int:
        return self._len

    @property
    def nbytes(self) -> int:
        """Bytes of the tokens held (the <= ``SLACK`` spare rows are not: under 0.4% of a 64K stream)."""
        data = self.data
        return 0 if data is None else data.numel() * data.element_size()


def quantize_groups(x: torch.Tensor, bits: int, reduce_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization of ``x`` with one (scale, min) per slice along ``reduce_dim``.

    Returns codes (uint8, one code per element), scale and minimum (``x.dtype``).
    """
    levels = 2**bits - 1
    mn = x.amin(dim=reduce_dim, keepdim=True)
    mx = x.amax(dim=reduce_dim, keepdim=True)
    # Constant slices get scale 1 so that codes are 0 and dequantization returns the minimum exactly.
    scale = torch.where(mx > mn, (mx - mn) / levels, torch.ones_like(mx))
    codes = ((x - mn) / scale).round_().clamp_(0, levels).to(torch.uint8)
    return codes, scale, mn


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack pairs of 4-bit codes along the last dim (even length) into bytes."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, axis: str, group: int,
               bits: int = 4) -> torch.Tensor:
    """KIVI groups back to values, [b, h, t, d] in ``scale``'s dtype.

    ``codes`` [b, h, t, d] (or [b, h, t, d/2] packed when ``bits == 4``); ``axis="channel"``: ``scale`` and
    ``minimum`` are [b, h, t / group, 1, d] (one per channel and group of tokens); ``"token"``:
    [b, h, t, d / min(group, d), 1] (one per token and group of channels).
    """
    codes = unpack_nibbles(codes) if bits == 4 else codes
    b, h, t, d = codes.shape
    if axis == "channel":
        grouped = codes.view(b, h, t // group, group, d)
    else:
        gd = min(group, d)
        grouped = codes.view(b, h, t, d // gd, gd)
    return torch.addcmul(minimum, grouped.to(scale.dtype), scale).view(b, h, t, d)


class QuantizedTokenStore:
    """A token stream stored as ``bits``-bit groups plus a full-precision residual.

    Args:
        axis: ``"channel"`` (KIVI keys: range per channel over ``group`` tokens) or
            ``"token"`` (KIVI values: range per token over ``group`` channels).
        bits: 4 (packed two per byte) or 8.
        group: Tokens per quantized block (and channels per group for ``"token"``).
    """

    def __init__(self, axis: str = "channel", bits: int = 4, group: int = 128):
        if axis not in ("channel", "token") or bits not in (4, 8):
            raise ValueError(f"unsupported axis={axis!r} bits={bits}")
        self.axis, self.bits, self.group = axis, bits, group
        # Every quantized group side by side in one tensor each (codes [b, h, T, d or d/2], scales and minima),
        # so that a read is a handful of kernels over the whole prefix, not a few per group: at 64K tokens
        # in groups of 64 a per-group read launched thousands of kernels per layer per decode step.
        self.codes: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.minimum: torch.Tensor | None = None
        self.residual: torch.Tensor | None = None
        self.num_quantized = 0
        self._dtype = None

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Quantize ``x`` [b, h, n * group, d] as ``n`` groups at once (the same ranges as group by group)."""
        b, h, t, d = x.shape
        if self.axis == "channel":  # one range per (group of tokens, channel)
            codes, scale, mn = quantize_groups(x.view(b, h, t // self.group, self.group, d), self.bits, reduce_dim=3)
        else:  # one range per (token, group of channels)
            gd = min(self.group, d)
            codes, scale, mn = quantize_groups(x.view(b, h, t, d // gd, gd), self.bits, reduce_dim=-1)
        codes = codes.view(b, h, t, d)
        if self.bits == 4:
            codes = pack_nibbles(codes)
        return codes, scale, mn

    def _dequantize(self) -> torch.Tensor:
        return dequantize(self.codes, self.scale, self.minimum, self.axis, self.group, self.bits)

    def rows(self, batch_idx: torch.Tensor, token_idx: torch.Tensor) -> torch.Tensor:
        """The stored (dequantized) rows of the given (batch, token) pairs, [n, h, d] in the input dtype."""
        out = torch.empty(batch_idx.numel(), *self._row_shape, dtype=self._dtype, device=batch_idx.device)
        nq = self.num_quantized
        quantized = token_idx < nq
        if quantized.any():
            bi, ti = batch_idx[quantized], token_idx[quantized]
            codes = self.codes[bi, :, ti]  # [n, h, d or d/2]
            codes = (unpack_nibbles(codes) if self.bits == 4 else codes).to(self.scale.dtype)
            n, h, d = codes.shape
            if self.axis == "channel":  # one range per channel: [n, h, 1, d]
                g = ti // self.group
                rows = torch.addcmul(self.minimum[bi, :, g, 0], codes, self.scale[bi, :, g, 0])
            else:  # one range per group of channels: [n, h, d / gd, 1]
                gd = min(self.group, d)
                rows = torch.addcmul(self.minimum[bi, :, ti], codes.view(n, h, d // gd, gd), self.scale[bi, :, ti])
            out[quantized] = rows.reshape(n, h, d).to(self._dtype)
        if (~quantized).any():
            out[~quantized] = self.residual[batch_idx[~quantized], :, token_idx[~quantized] - nq]
        return out

    def token_norms(self, block: int = 4096) -> torch.Tensor:
        """Per (batch, token) norm over heads and dims of the stored (dequantized) states, [b, tokens] fp32.

        Dequantized ``block`` tokens at a time: never a copy of the whole stream."""
        parts = []
        step = max(self.group, block // self.group * self.group)
        for start in range(0, self.num_quantized, step):
            end = min(self.num_quantized, start + step)
            g0, g1 = (start // self.group, end // self.group) if self.axis == "channel" else (start, end)
            x = dequantize(self.codes[:, :, start:end], self.scale[:, :, g0:g1], self.minimum[:, :, g0:g1], self.axis,
                           self.group, self.bits).to(self._dtype)
            parts.append(torch.linalg.vector_norm(x, dim=(1, 3), dtype=torch.float32))
        if self.residual is not None and self.residual.shape[-2]:
            parts.append(torch.linalg.vector_norm(self.residual, dim=(1, 3), dtype=torch.float32))
        return torch.cat(parts, dim=-1)

    def append(self, x: torch.Tensor) -> None:
        self._dtype, self._row_shape = x.dtype, (x.shape[1], x.shape[3])
        self.residual = x if self.residual is None else torch.cat([self.residual, x], dim=-2)
        whole = self.residual.shape[-2] // self.group * self.group
        if not whole:
            return
        # The leftover is copied out: a view of it would keep the whole appended block alive (a prompt's bf16
        # states behind every 4-bit layer, uncounted by ``nbytes``: the 32K throughput run ran out of memory).
        block = self.residual[:, :, :whole].contiguous()
        self.residual = self.residual[:, :, whole:].clone(memory_format=torch.contiguous_format)
        new = self._quantize(block)
        # axis 2 is the token axis of the codes and (channel axis) of the per-group ranges alike
        if self.codes is None:
            self.codes, self.scale, self.minimum = new
        else:
            self.codes, self.scale, self.minimum = (torch.cat([old, n], dim=2) for old, n in
                                                    zip((self.codes, self.scale, self.minimum), new))
        self.num_quantized += whole

    def read(self) -> torch.Tensor | None:
        parts = [] if self.codes is None else [self._dequantize().to(self._dtype)]
        if self.residual is not None and self.residual.shape[-2] > 0:
            parts.append(self.residual)
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts, dim=-2) if parts else None

    def __len__(self) -> int:
        return self.num_quantized + (0 if self.residual is None else self.residual.shape[-2])

    @property
    def nbytes(self) -> int:
        tensors = [t for t in (self.codes, self.scale, self.minimum, self.residual) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


def make_store(quant_bits: int | None, axis: str, group: int):
    """A plain store when ``quant_bits`` is None, else a KIVI store along ``axis``."""
    return PlainTokenStore() if quant_bits is None else QuantizedTokenStore(axis=axis, bits=quant_bits, group=group)
