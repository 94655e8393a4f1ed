"""``zgemv`` (the 12-bit lossless layout decoded in registers) against its fp32 reference, on fresh random inputs.

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1) on small shapes: ragged N and K (K odd,
K not a multiple of 8), 1 to 8 rows of x, every split path, many escapes; the interpreter truncates
fp32->bf16, so bf16 outputs are compared within one bf16 step of the output's scale, fp32 ones closely. The
machine-code test compiles the kernel for an H100/H200 (sm_90) with the GPU image's Triton: the decode stays
in registers. The ``gpu`` test runs Llama-3-8B's decode shapes.
"""

import collections
import re
import subprocess
import sys

import pytest
import torch

kz = pytest.importorskip("neutrain.kernels.zgemv")

from neutrain.compress.zgemv import ZgemvWeight, zgemv_reference  # noqa: E402
from tests.helpers import REPO, triton36_env  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def weight(n: int, k: int, seed: int, escapes: float = 0.02) -> torch.Tensor:
    """Trained-like bf16 weights with a share of escapes (tiny, huge, subnormal) and exact zeros."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.02
    pick = torch.rand(n, k, generator=gen)
    w = torch.where(pick < escapes / 3, w * 1e-6, w)
    w = torch.where((pick >= escapes / 3) & (pick < 2 * escapes / 3), w * 1e4, w)
    w = torch.where((pick >= 2 * escapes / 3) & (pick < escapes), 1e-39, w)
    w = torch.where(torch.rand(n, k, generator=gen) < 0.01, 0.0, w)
    return w.bfloat16().to(DEVICE)


def close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[float, float]:
    """(max error, allowed): one bf16 step of the largest output for bf16, 1e-5 of it for fp32."""
    want = x.double() @ w.double().T
    scale = want.abs().max().item()
    return (y.double() - want).abs().max().item(), scale * (2.0**-7 if y.dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("n,k", [(40, 304), (17, 64), (33, 99), pytest.param(64, 1024, marks=pytest.mark.slow)])
@pytest.mark.parametrize("split,serial,prmt", [(1, True, True), (3, True, False), (3, False, True)])
def test_one_row_equals_the_reference(n, k, split, serial, prmt):
    w = weight(n, k, seed=n * 31 + k)
    zw = ZgemvWeight.from_bf16(w)
    assert zw.escapes > 0
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(1, 1, k, generator=torch.Generator().manual_seed(split)).to(dtype).to(DEVICE)
        y = kz.zgemv(x, zw, block_n=16, block_k=64, split=split, serial=serial, prmt=prmt)
        assert y.shape == (1, 1, n) and y.dtype == dtype
        err, allowed = close(y.reshape(1, n), x.reshape(1, k), w)
        assert err <= allowed, (dtype, err, allowed)
    assert not zw.counters.any()  # the serial reduction left its counters at 0 for the next call


@pytest.mark.parametrize("m", [2, 3, 8])
@pytest.mark.parametrize("split", [1, 2])
def test_a_few_rows_read_the_weight_once_and_equal_the_reference(m, split):
    """And the byte permutes (emulated here) give the bits the shifts and masks give."""
    n, k = 48, 200
    w = weight(n, k, seed=m)
    zw = ZgemvWeight.from_bf16(w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + 7)).to(DEVICE)
    y = kz.zgemv(x, zw, block_n=16, block_k=32, split=split)
    assert y.shape == (m, n)
    err, allowed = close(y, x, w)
    assert err <= allowed
    torch.testing.assert_close(y, zgemv_reference(x, zw), atol=allowed, rtol=0)
    assert torch.equal(y, kz.zgemv(x, zw, block_n=16, block_k=32, split=split, prmt=False))


def test_unmasked_tiles_and_bf16_words_of_x():
    """N and K multiples of the blocks: the loop without masks, x read as 32-bit words of two bf16."""
    n, k = 64, 512
    w = weight(n, k, seed=5)
    zw = ZgemvWeight.from_bf16(w)
    x = torch.randn(k, generator=torch.Generator().manual_seed(5)).bfloat16().to(DEVICE)
    for split, prmt in ((1, True), (2, False)):
        y = kz.zgemv(x, zw, block_n=32, block_k=128, split=split, prmt=prmt)
        err, allowed = close(y[None], x[None], w)
        assert y.shape == (n,) and err <= allowed
    # the check can fail: the weight of another matrix is far outside it
    other = ZgemvWeight.from_bf16(weight(n, k, seed=6))
    err, allowed = close(kz.zgemv(x, other, block_n=32, block_k=128)[None], x[None], w)
    assert err > 10 * allowed


def test_deterministic_and_nonfinite_weights_propagate():
    n, k = 24, 96
    w = weight(n, k, seed=3)
    w[5, 7] = float("nan")
    w[9, 0] = float("inf")
    zw = ZgemvWeight.from_bf16(w)
    x = torch.rand(k, generator=torch.Generator().manual_seed(3)).add(0.1).to(DEVICE)  # positive: inf stays inf
    y = kz.zgemv(x, zw, block_n=8, block_k=32, split=2)
    again = kz.zgemv(x, zw, block_n=8, block_k=32, split=2)
    assert torch.equal(y.view(torch.int32), again.view(torch.int32))  # bit for bit, twice
    assert torch.isnan(y[5]) and y[9] == float("inf") and torch.isfinite(y[[0, 1, 2, 3, 4, 6, 7, 8]]).all()


def test_x_beyond_the_exact_range_gives_inf_not_a_wrong_number():
    w = weight(8, 64, seed=4, escapes=0.0)
    zw = ZgemvWeight.from_bf16(w)
    x = torch.full((64,), 2.0**49).to(DEVICE)
    assert not torch.isfinite(kz.zgemv(x, zw, block_n=8, block_k=32)).any()
    x = torch.full((64,), 2.0**40).to(DEVICE)  # inside: exact
    err, allowed = close(kz.zgemv(x, zw, block_n=8, block_k=32)[None], x[None], w)
    assert err <= allowed


def test_refuses_bad_shapes_and_dtypes():
    zw = ZgemvWeight.from_bf16(weight(8, 16, seed=0))
    with pytest.raises(ValueError, match="1 to 8 rows"):
        kz.zgemv(torch.ones(9, 16, device=DEVICE), zw)
    with pytest.raises(ValueError, match="needs 16"):
        kz.zgemv(torch.ones(1, 12, device=DEVICE), zw)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        kz.zgemv(torch.ones(1, 16, dtype=torch.float64, device=DEVICE), zw)
    with pytest.raises(ValueError, match="powers of two"):
        kz.zgemv(torch.ones(16, device=DEVICE), zw, block_n=24)
    with pytest.raises(ValueError, match="powers of two"):
        kz.zgemv(torch.ones(16, device=DEVICE), zw, block_k=4)


_SASS = """
import collections, json, re
from benchmarks.codec.codec_sass import longest_loop
from benchmarks.decode.zgemv import zgemv_sass
out = {}
for name, m, block_n, prmt in (("prmt", 1, 64, True), ("masks", 1, 64, False), ("rows8", 8, 16, True)):
    sass, regs, spills = zgemv_sass(block_n=block_n, block_k=256, num_warps=4, rows=m, split=1, prmt=prmt)
    body = longest_loop(sass)
    ops = collections.Counter(re.sub(r"^@!?U?P\\w+\\s+", "", t).split()[0] for t in body)
    out[name] = {"length": len(body), "ops": ops, "regs": regs, "spills": spills}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_decode_for_sm90_stays_in_registers():
    """One row, 64 x 256 weights a step over 128 threads: 128 weights a thread at 4 instructions each with byte
    permutes (measured 3.91 with Triton 3.6; 4.66 with shifts and masks; the dense gemv's loop takes 3.2),
    16-byte loads, no shared memory, no local memory, no stores in the loop."""
    env, reason = triton36_env()
    if reason:
        pytest.skip(reason)
    proc = subprocess.run([sys.executable, "-c", _SASS], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    import json

    loops = json.loads(proc.stdout.split("RESULT ", 1)[1])
    for name, most in (("prmt", 4.0), ("masks", 4.75)):
        loop = loops[name]
        ops = collections.Counter(loop["ops"])
        assert loop["length"] <= most * 128, (name, loop["length"], ops)
        assert ops["FFMA"] == 128  # one FMA a weight
        assert ops["LDG.E.128"] == 16 and not any(re.match(r"(LDS|STS|LDL|STL|STG|BAR)", op) for op in ops), ops
        assert loop["spills"] == 0
    assert collections.Counter(loops["prmt"]["ops"])["PRMT"] == 128  # one permute a weight
    eight = loops["rows8"]  # eight rows of x, 16 x 256 weights a step: each decoded weight feeds 8 FMAs
    assert collections.Counter(eight["ops"])["FFMA"] == 8 * 32 and eight["spills"] == 0


@pytest.mark.gpu
def test_llama3_8b_shapes_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for n, k in [(1024, 4096), (4096, 14336)]:
        gen = torch.Generator(device="cuda").manual_seed(n)
        w = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).bfloat16()
        zw = ZgemvWeight.from_bf16(w)
        x = torch.randn(1, k, generator=gen, device="cuda").bfloat16()
        for config in ((32, 256, 1, True), (64, 256, 4, True), (16, 512, 8, False)):
            y = kz.zgemv(x, zw, block_n=config[0], block_k=config[1], split=config[2], prmt=config[3])
            err, allowed = close(y, x, w)
            assert err <= allowed, (config, err, allowed)
        assert torch.equal(kz.zgemv(x, zw, prmt=True), kz.zgemv(x, zw, prmt=False))  # the permutes: the same bits
