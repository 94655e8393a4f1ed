"""The data format SageAttention's kernels and their torch reference share.

Constants, the quantized-inputs container and V's FP8 scale live here, below both the
kernels (:mod:`neutrain.kernels.sage_attention` and its siblings) and the attention
layer (:mod:`neutrain.attention.quant`), so that neither imports the other for them.
This module needs torch only, never Triton. See :mod:`neutrain.attention.quant` for
the quantization scheme.

Example:
    >>> round_up(40, TILE)
    128
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: Keys per KV tile. The kernel's KV tile, the FP8 quantization tile of P (each
#: tile's P is quantized against that tile's own row max) and the backward's KV
#: tile must agree, so it is one constant.
TILE = 128
#: Largest finite FP8 E4M3 value; P is quantized with this fixed scale.
FP8_MAX = 448.0
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
LOG2_FP8_MAX = math.log2(FP8_MAX)
#: The V residual is stored multiplied by this (|residual| <= 16 in scaled units, so <= 256).
V_RESIDUAL_GAIN = 16.0
#: Smallest scale, so that all-zero groups (padding) quantize to 0 instead of NaN.
_MIN_AMAX = 1e-6


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n``."""
    return (n + multiple - 1) // multiple * multiple


@dataclass
class QuantizedAttentionInputs:
    """Quantized Q, K, V (padded to ``n_pad`` tokens) plus everything to dequantize them.

    Attributes:
        q_int: [B, Hq, Np, D] int8 (smoothed residual when ``q_mean`` is set).
        q_scale: [B, Hq, Np] fp32 per-token scale, including ``softmax_scale * log2(e)``.
        q_mean: [B, Hq, Np, D] bf16 per-token copy of its group's mean, pre-multiplied
            by ``softmax_scale * log2(e)``; ``None`` without Q smoothing.
        k_int: [B, Hk, Np, D] int8 of the smoothed K.
        k_scale: [B, Hk, Np] fp32.
        k_mean: [B, Hk, 1, D] fp32 mean that was subtracted from K.
        v_fp8_t: [B, Hk, D, Np] float8_e4m3fn, V transposed.
        v_residual_t: like ``v_fp8_t``, ``V_RESIDUAL_GAIN * (V/scale - v_fp8)`` in FP8, or ``None``.
        v_scale: [B, Hk, D] fp32 per-channel scale.
        seq_len: the unpadded sequence length N.
        softmax_scale: the attention scale (usually D**-0.5).
        k_group: tokens sharing one K scale (:data:`TILE`: one scale per KV tile, which the
            kernel folds into its row factor).
    """

    q_int: torch.Tensor
    q_scale: torch.Tensor
    q_mean: torch.Tensor | None
    k_int: torch.Tensor
    k_scale: torch.Tensor
    k_mean: torch.Tensor
    v_fp8_t: torch.Tensor
    v_residual_t: torch.Tensor | None
    v_scale: torch.Tensor
    seq_len: int
    softmax_scale: float
    k_group: int = 16


def fp8_channel_scale(v: torch.Tensor) -> torch.Tensor:
    """Per-channel FP8 scale of V [B, H, N, D]: ``amax over tokens / 448`` as [B, H, D], in fp32.

    Why a 0-dim tensor divisor: on CUDA, ``tensor / python_float`` multiplies by the
    rounded reciprocal, which differs from CPU's true division in the last bit for about
    half of the channels. V in bf16 over such a scale lands exactly on FP8 rounding ties
    often (short mantissas), so that last bit flipped ~0.1% of FP8 values between devices.
    A tensor divisor is a true IEEE division everywhere.
    """
    amax = v.abs().amax(dim=2).float().clamp_min(_MIN_AMAX)
    return amax / amax.new_full((), FP8_MAX)
