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
    """A growing ``[batch, heads, tokens, dim]`` tensor (the unquantized counterpart)."""

    def __init__(self):
        self.data: torch.Tensor | None = None

    def append(self, x: torch.Tensor) -> None:
        self.data = x if self.data is None else torch.cat([self.data, x], dim=-2)

    def read(self) -> torch.Tensor | None:
        return self.data

    def __len__(self) -> int:
        return 0 if self.data is None else self.data.shape[-2]

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.numel() * self.data.element_size()


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
        codes = unpack_nibbles(self.codes) if self.bits == 4 else self.codes
        b, h, t, d = codes.shape
        if self.axis == "channel":
            grouped = codes.view(b, h, t // self.group, self.group, d)
        else:
            gd = min(self.group, d)
            grouped = codes.view(b, h, t, d // gd, gd)
        return torch.addcmul(self.minimum, grouped.to(self.scale.dtype), self.scale).view(b, h, t, d)

    def append(self, x: torch.Tensor) -> None:
        self._dtype = x.dtype
        self.residual = x if self.residual is None else torch.cat([self.residual, x], dim=-2)
        whole = self.residual.shape[-2] // self.group * self.group
        if not whole:
            return
        block, self.residual = self.residual[:, :, :whole].contiguous(), self.residual[:, :, whole:]
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
