"""Stochastic rounding from fp32 to bf16, and deterministic per-update seeding.

Why stochastic rounding: fused updates keep no fp32 master copy, so an update
smaller than half a bf16 ulp of the weight (``|lr * g| < 2**-9 * |w|``) would be
rounded away every step and training would stall (docs/trainer.md §1: "bf16-only
storage rounds small updates away"). Rounding up with probability equal to the
discarded fraction makes the stored weight unbiased: ``E[round(x)] == x``.

The rounding is done with integer arithmetic on the fp32 bit pattern: add a
uniform random 16-bit integer to the low half and truncate. Because IEEE floats
are sign-magnitude, this rounds the magnitude, which is what we want for both
signs. Integer rounding is also bit-identical on CPU, GPU and in any future
Triton kernel (Triton's CPU interpreter truncates fp32->bf16 casts).

Seeding: each tensor update reseeds one generator per device from
``(seed, tensor index, step)``, so the random bits a weight sees do not depend on
the order in which backward visits tensors. Dense (hook-driven) and compressed
(module-driven) training therefore round identically, and a resumed run
reproduces the uninterrupted one without saving generator state.
"""

from __future__ import annotations

import torch

_BF16_MAX = torch.finfo(torch.bfloat16).max
_MIX_A = 0x9E3779B1  # golden-ratio constants keep nearby (index, step) seeds apart
_MIX_B = 0x85EBCA77


def stochastic_round_to_bf16(
    x: torch.Tensor, generator: torch.Generator | None = None, *, saturate: bool = True
) -> torch.Tensor:
    """Round an fp32 tensor to bf16, up or down with probability given by the remainder.

    NaN stays NaN and infinities stay infinite (callers mask non-finite updates out).

    Args:
        x: fp32 tensor (any shape, any device).
        generator: random source on ``x.device``; ``None`` uses the global one.
        saturate: clamp finite values to the largest finite bf16 first, so finite
            inputs never produce infinities. The fused optimizers pass False and
            instead reject non-finite results (two fewer passes over the data).

    Returns:
        A bf16 tensor of the same shape.

    Example:
        >>> x = torch.full((10000,), 1.0 + 2**-10)   # a quarter ulp above 1.0 in bf16
        >>> y = stochastic_round_to_bf16(x, torch.Generator().manual_seed(0)).float()
        >>> abs(y.mean().item() - (1.0 + 2**-10)) < 2e-4
        True
    """
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round_to_bf16 expects fp32, got {x.dtype}")
    if saturate:
        # The largest bf16 has bit pattern 0x7F7F0000: adding at most 0xFFFF to it cannot
        # carry into the exponent of inf. NaN and inf pass through.
        x = torch.where(torch.isfinite(x), x.clamp(-_BF16_MAX, _BF16_MAX), x)
    bits = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    bits.add_(x.contiguous().view(torch.int32))
    # Truncating to the high 16 bits of each word yields the bf16 pattern (for either sign,
    # since floats are sign-magnitude). Arithmetic shift then int16 narrowing keeps them.
    return (bits >> 16).to(torch.int16).view(torch.bfloat16)


def round_to_bf16(x: torch.Tensor, generator: torch.Generator | None, stochastic: bool) -> torch.Tensor:
    """fp32 -> bf16 with stochastic rounding or round-to-nearest-even (torch's cast)."""
    if stochastic:
        return stochastic_round_to_bf16(x, generator)
    return x.to(torch.bfloat16)


def update_seed(seed: int, tensor_index: int, step: int) -> int:
    """A 63-bit seed for one tensor's update at one step (order-independent, resumable)."""
    mixed = (seed * _MIX_A) ^ ((tensor_index + 1) * _MIX_B) ^ ((step + 1) * 0x27D4EB2F165667C5)
    return mixed & 0x7FFF_FFFF_FFFF_FFFF


class SeededGenerators:
    """One ``torch.Generator`` per device, reseeded for every tensor update.

    Example:
        >>> gens = SeededGenerators(seed=1)
        >>> g = gens.for_update(torch.device("cpu"), tensor_index=3, step=7)
        >>> a = torch.rand(2, generator=g)
        >>> b = torch.rand(2, generator=gens.for_update(torch.device("cpu"), 3, 7))
        >>> bool((a == b).all())
        True
    """

    def __init__(self, seed: int):
        self.seed = int(seed)
        self._generators: dict[torch.device, torch.Generator] = {}

    def for_update(self, device: torch.device, tensor_index: int, step: int) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            self._generators[device] = generator
        generator.manual_seed(update_seed(self.seed, tensor_index, step))
        return generator
