"""``fused_update`` (one-kernel LOMO update) against the eager update it replaces.

On CPU the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1) on
small tensors, with values whose products are exact (the interpreter and torch's CPU
kernels may differ in fused multiply-adds and truncate fp32->bf16 casts); the ``gpu``
tests compare at full size with arbitrary values, bf16 round-to-nearest included.
"""

import pytest
import torch

kfu = pytest.importorskip("neutrain.kernels.fused_update")

from neutrain.optim import LOMO  # noqa: E402
from neutrain.optim.rule import scaled  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def eager_update(w, g, *, lr, weight_decay=0.0, coef=None, ok=True):
    """The eager path's arithmetic (LOMO._rule_chunk + ChunkedRule._write_rows), round to nearest."""
    p = w.to(torch.float32, copy=True)
    if weight_decay:
        p.mul_(1.0 - lr * weight_decay)
    p.add_(g if coef is None else scaled(g, coef), alpha=-lr)
    new = p.to(w.dtype)
    keep = torch.isfinite(new) & torch.as_tensor(ok, device=w.device)
    return torch.where(keep, new, w)


def _inputs(n, dtype, seed, device=DEVICE, specials=True):
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, generator=gen, device=device).to(dtype)
    g = torch.randn(n, generator=gen, device=device).to(dtype)
    if specials:
        w[:4] = torch.tensor([0.0, -0.0, 3.0e38, 1e-40])
        g[4:8] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    return w, g


@pytest.mark.parametrize("coef", [None, 0.25])
@pytest.mark.parametrize("weight_decay", [0.0, 0.5])
def test_fp32_weights_match_the_eager_update_exactly(coef, weight_decay):
    w, g = _inputs(300, torch.float32, seed=1)
    c = None if coef is None else torch.tensor(coef, device=DEVICE)
    ok = torch.tensor(True, device=DEVICE)
    want = eager_update(w, g, lr=0.5, weight_decay=weight_decay, coef=c)
    got = kfu.fused_update_(w.clone(), g, lr=0.5, weight_decay=weight_decay, coef=c, ok=ok)
    assert torch.equal(got, want)
    assert torch.isfinite(got).all()  # 3e38 + overflowing steps keep their old value


def test_a_nonfinite_flag_leaves_the_weight_untouched():
    w, g = _inputs(200, torch.bfloat16, seed=2)
    got = kfu.fused_update_(w.clone(), g, lr=0.5, ok=torch.tensor(False, device=DEVICE), seed=7)
    assert torch.equal(got, w)


def test_stochastic_rounding_is_unbiased_deterministic_and_chunk_invariant():
    n = 4096
    w = torch.ones(n, dtype=torch.bfloat16, device=DEVICE)
    g = torch.full((n,), -(2.0**-9), dtype=torch.float32, device=DEVICE)  # a quarter bf16 ulp above 1
    ok = torch.tensor(True, device=DEVICE)
    a = kfu.fused_update_(w.clone(), g, lr=1.0, ok=ok, seed=11)
    assert set(a.float().unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    assert abs(a.float().mean().item() - (1 + 2.0**-9)) < 4e-4
    assert torch.equal(a, kfu.fused_update_(w.clone(), g, lr=1.0, ok=ok, seed=11))
    assert not torch.equal(a, kfu.fused_update_(w.clone(), g, lr=1.0, ok=ok, seed=12))
    halves = w.clone()
    kfu.fused_update_(halves[: n // 2], g[: n // 2], lr=1.0, ok=ok, seed=11, base=0)
    kfu.fused_update_(halves[n // 2:], g[n // 2:], lr=1.0, ok=ok, seed=11, base=n // 2)
    assert torch.equal(halves, a)
    # A zero step never moves a bf16 weight, whatever the noise.
    w2, _ = _inputs(500, torch.bfloat16, seed=3, specials=False)
    assert torch.equal(kfu.fused_update_(w2.clone(), torch.zeros_like(w2), lr=1.0, ok=ok, seed=5), w2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("coef", [None, "tensor"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_kernel_equals_eager_at_full_size_on_gpu(dtype, coef, weight_decay):
    w, g = _inputs(4096 * 4096 + 7, dtype, seed=4)
    c = None if coef is None else torch.tensor(0.37, device="cuda")
    ok = torch.tensor(True, device="cuda")
    want = eager_update(w, g, lr=1.3e-3, weight_decay=weight_decay, coef=c)
    got = kfu.fused_update_(w.clone(), g, lr=1.3e-3, weight_decay=weight_decay, coef=c, ok=ok)
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_lomo_with_the_kernel_equals_lomo_without_it(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 64)).cuda().bfloat16()
    twin = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(32, 512, device="cuda", dtype=torch.bfloat16)
    results = []
    for env in ("1", "0"):
        monkeypatch.setenv("NEUTRAIN_FUSED_UPDATE", env)
        with torch.no_grad():
            for p, t in zip(model.parameters(), twin):
                p.copy_(t)
        opt = LOMO(model.parameters(), lr=1e-2, stochastic_rounding=False, clip_mode="per_tensor",
                   max_grad_norm=0.5, chunk_numel=4096).bind(model)
        for _ in range(3):
            opt.backward(model(x).float().pow(2).mean())
            opt.step()
        opt.unbind()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert not torch.equal(results[0][0], twin[0])


@pytest.mark.parametrize("path", ["kernel", "eager"])
def test_a_nan_with_cudas_bit_pattern_never_rounds_into_a_finite_weight(path):
    """CUDA's arithmetic NaN is 0x7FFFFFFF; stochastic rounding adds up to 0xFFFF to the fp32 pattern,
    which wraps it to 0x8000xxxx, whose high half is -0.0: a finite bf16 that a test of the rounded
    value alone stores (seen on an H100: poisoned lm_head elements became -0.0). The weight must keep its
    value there, with ``ok`` true (an element-wise keep, as the single-pass streamed update runs)."""
    from neutrain.optim.rule import ChunkedRule

    w = torch.randn(64, device=DEVICE).bfloat16()
    g = torch.zeros(64, device=DEVICE)
    g.view(torch.int32)[5::7] = 0x7FFFFFFF  # the CUDA NaN pattern; the CPU keeps payloads through arithmetic
    ok = torch.tensor(True, device=DEVICE)
    if path == "kernel":
        got = kfu.fused_update_(w.clone(), g, lr=0.5, ok=ok, seed=11)
    else:
        new32 = w.float().add_(g, alpha=-0.5)
        assert (new32.view(torch.int32)[5::7] == 0x7FFFFFFF).all() or DEVICE == "cuda"
        got = w.clone()
        ChunkedRule._write_rows(None, got, new32, ok, torch.Generator(device=DEVICE).manual_seed(11))
    assert torch.equal(got[5::7].view(torch.int16), w[5::7].view(torch.int16))
    assert torch.isfinite(got).all()
