"""Stochastic rounding fp32 -> bf16: unbiased, neighbour-only, saturating, seeded."""

import torch

from neutrain.optim.rounding import SeededGenerators, round_to_bf16, stochastic_round_to_bf16, update_seed


def _neighbours(x):
    down = x.to(torch.bfloat16)  # nearest; find the bracketing pair around x
    lo = torch.where(down.float() > x, torch.nextafter(down, torch.tensor(-float("inf"), dtype=torch.bfloat16)), down)
    hi = torch.where(down.float() < x, torch.nextafter(down, torch.tensor(float("inf"), dtype=torch.bfloat16)), down)
    return lo, hi


def test_rounds_to_one_of_the_two_neighbours():
    x = torch.randn(4096) * torch.logspace(-20, 20, 4096)
    y = stochastic_round_to_bf16(x, torch.Generator().manual_seed(1))
    lo, hi = _neighbours(x)
    assert bool(((y == lo) | (y == hi)).all())
    assert bool((y != x.to(torch.bfloat16)).any()), "some values must round away from nearest"


def test_unbiased_on_average():
    base = torch.randn(64)
    x = base.repeat(20000, 1)
    y = stochastic_round_to_bf16(x, torch.Generator().manual_seed(2)).float().mean(0)
    ulp = (torch.nextafter(base.to(torch.bfloat16), torch.tensor(float("inf"), dtype=torch.bfloat16)).float()
           - base.to(torch.bfloat16).float()).abs()
    # Nearest rounding is off by up to ulp/2; the stochastic mean must be far closer.
    assert bool(((y - base).abs() < 0.03 * ulp).all())


def test_saturates_instead_of_overflowing_and_keeps_specials():
    big = torch.full((1000,), torch.finfo(torch.bfloat16).max * 1.001)
    y = stochastic_round_to_bf16(torch.cat([big, -big]), torch.Generator().manual_seed(3))
    assert bool(torch.isfinite(y).all())
    specials = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0])
    z = stochastic_round_to_bf16(specials, torch.Generator().manual_seed(3))
    assert z[0] == float("inf") and z[1] == -float("inf") and torch.isnan(z[2]) and z[3] == 0 and z[4] == 0


def test_seeded_and_nearest_modes():
    x = torch.randn(1000)
    gens = SeededGenerators(seed=5)
    a = round_to_bf16(x, gens.for_update(torch.device("cpu"), 2, 9), True)
    b = round_to_bf16(x, gens.for_update(torch.device("cpu"), 2, 9), True)
    c = round_to_bf16(x, gens.for_update(torch.device("cpu"), 2, 10), True)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(round_to_bf16(x, None, False), x.to(torch.bfloat16))
    assert len({update_seed(0, i, s) for i in range(50) for s in range(50)}) == 2500
