"""Split-K batch-1 GEMV (Triton) against its fp32 reference, on fresh random inputs.

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1) on small shapes (ragged N and K,
every split path); the interpreter truncates fp32->bf16, so bf16 is compared within one bf16 step of
the output's scale. The ``gpu`` test runs Llama-3-8B's decode shapes.
"""

import pytest
import torch

kgemv = pytest.importorskip("neutrain.kernels.gemv")

from neutrain.decode.gemv import gemv_reference  # noqa: E402

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
    from benchmarks.decode.engine_decode import choose_gemv

    rows = choose_gemv([(6144, 4096), (4096, 14336)], candidates=((16, 256, 1), (16, 512, 4)), iters=10)
    for row in rows:
        assert not row["errors"], row["errors"]
        assert set(row["times_ms"]) == {"cublas", "triton_n16_k256_s1", "triton_n16_k512_s4"}  # all ran
        assert row["best_bytes_per_s"] > 1e11, row  # a GEMV reads its weight at > 100 GB/s


def test_engine_routes_its_one_row_linears_to_the_chosen_gemv():
    """``DecodeEngine(gemv=table)``: the decode step's one-row linears of the table's shapes run the Triton
    GEMV (counted), prefill's many-row ones stay ``F.linear``, and the decode is the plain engine's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from neutrain.decode.engine import DecodeEngine

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    want = DecodeEngine(model, max_len=16, fuse=True).generate(prompt, 6)
    table = {(64, 32): (8, 64, 1), (128, 32): (16, 64, 2), (32, 64): (8, 64, 2)}
    engine = DecodeEngine(model, max_len=16, fuse=True, gemv=table)  # fused QKV is 64 x 32, gate/up 128 x 32
    engine.prefill(prompt)
    assert engine.gemv.calls == 1  # the layers see five rows (F.linear); the lm_head only the last one
    logits = []
    for _ in range(5):
        engine.step()
        logits.append(engine.logits.clone())
    # per step and layer: QKV (64x32), gate/up (128x32), down (32x64); plus the lm_head (64x32)
    assert engine.gemv.calls == 1 + 5 * (2 * 3 + 1)
    reference = DecodeEngine(model, max_len=16, fuse=True)
    reference.prefill(prompt)
    for got in logits:
        reference.step()
        torch.testing.assert_close(got, reference.logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(engine.tokens[:, :11], want)  # prompt, the prefill's token, five steps


@pytest.mark.gpu
def test_cuda_graph_engine_with_the_triton_gemv_decodes_like_cublas():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from transformers import LlamaConfig, LlamaForCausalLM

    from neutrain.decode.engine import DecodeEngine

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(cfg).cuda().eval().requires_grad_(False)
    torch.backends.cuda.matmul.allow_tf32 = False
    prompt = torch.tensor([[3, 1, 4, 1, 5]], device="cuda")
    table = {(256, 128): (16, 128, 1), (512, 128): (8, 128, 2), (128, 256): (16, 128, 2)}  # QKV, lm_head; gate/up; down
    runs = []
    for gemv in (None, table):
        engine = DecodeEngine(model, max_len=64, fuse=True, gemv=gemv)
        out = engine.generate(prompt, 40)
        runs.append((out, engine.logits.clone(), engine))
    assert runs[1][2].use_graph and runs[1][2].gemv.calls > 0  # captured with the Triton GEMVs inside
    assert torch.equal(runs[0][0], runs[1][0])  # fp32: greedy identical
    torch.testing.assert_close(runs[1][1], runs[0][1], atol=1e-4, rtol=1e-4)
