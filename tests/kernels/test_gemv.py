"""Split-K batch-1 GEMV (Triton) against its fp32 reference, on fresh random inputs.

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1) on small shapes (ragged N and K,
every split path); the interpreter truncates fp32->bf16, so bf16 is compared within one bf16 step of
the output's scale. The ``gpu`` test runs Llama-3-8B's decode shapes.
"""

import pytest
import torch

kgemv = pytest.importorskip("neutrain.kernels.gemv")

from neutrain.eval.gemv import choose_gemv, gemv_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n,k", [(40, 300), (17, 64), (64, 1000)])
@pytest.mark.parametrize("split", [1, 2, 3])
@pytest.mark.parametrize("block_n,block_k", [(8, 64), (16, 128)])
def test_gemv_equals_the_fp32_reference(n, k, split, block_n, block_k):
    gen = torch.Generator(device=DEVICE).manual_seed(n * 31 + k + split)
    w = torch.randn(n, k, generator=gen, device=DEVICE)
    x = torch.randn(1, 1, k, generator=gen, device=DEVICE)
    y = kgemv.gemv(x, w, block_n=block_n, block_k=block_k, split=split)
    assert y.shape == (1, 1, n) and y.dtype == torch.float32
    torch.testing.assert_close(y, gemv_reference(x.double(), w.double()).float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("split", [1, 4])
def test_gemv_bf16_within_one_rounding_step(split):
    gen = torch.Generator(device=DEVICE).manual_seed(split)
    w = torch.randn(48, 512, generator=gen, device=DEVICE).to(torch.bfloat16)
    x = torch.randn(512, generator=gen, device=DEVICE).to(torch.bfloat16)
    y = kgemv.gemv(x, w, block_n=16, block_k=128, split=split)
    want = gemv_reference(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (48,)
    step = want.float().abs().max() * 2.0**-7  # one bf16 step at the largest output
    assert (y.float() - want.float()).abs().max() <= step
    # the check can fail: a wrong weight row block is far outside it
    assert (kgemv.gemv(x, w.roll(1, 0), split=split).float() - want.float()).abs().max() > step


def test_gemv_refuses_more_than_one_row():
    with pytest.raises(ValueError, match="one row"):
        kgemv.gemv(torch.ones(2, 8, device=DEVICE), torch.ones(4, 8, device=DEVICE))


@pytest.mark.gpu
def test_llama3_8b_shapes_have_a_correct_fastest_gemv():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rows = choose_gemv([(6144, 4096), (4096, 14336)], candidates=((16, 256, 1), (16, 512, 4)), iters=10)
    for row in rows:
        assert not row["errors"], row["errors"]
        assert set(row["times_ms"]) == {"cublas", "triton_n16_k256_s1", "triton_n16_k512_s4"}  # all ran
        assert row["best_bytes_per_s"] > 1e11, row  # a GEMV reads its weight at > 100 GB/s
