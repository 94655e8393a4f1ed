"""The decode engine on a NeuZip model with ``zgemv=True``: each decode step reads every compressed matrix through
``zgemv`` (the 12-bit layout decoded in registers; Triton's interpreter on the CPU), prefill keeps the compressed
path, and the greedy tokens are the dense bf16 engine's."""

import copy

import pytest
import torch

pytest.importorskip("triton")

from neutrain.decode.engine import DecodeEngine  # noqa: E402
from neutrain.decode.zgemv import ZgemvLinear, attach_zgemv, detach_zgemv  # noqa: E402
from neutrain.nn import CompressedLinear  # noqa: E402
from tests.unit.decode.test_fused_projections import _decode_logits, tiny  # noqa: E402

PROMPT = torch.tensor([[4, 9, 33, 2, 17, 40, 1, 5, 8, 21]])  # 10 rows: more than zgemv takes (a prefill)


def _compressed_pair(seed=3, layers=1):
    from neutrain.nn.convert import compress_model

    dense = tiny(seed, dtype=torch.bfloat16, layers=layers)
    compressed = copy.deepcopy(dense)
    compress_model(compressed, progress=False)
    for model in (dense, compressed):
        model.requires_grad_(False)
    return dense, compressed


@pytest.mark.slow
def test_greedy_decode_through_zgemv_equals_the_dense_bf16_engine(monkeypatch):
    import neutrain.kernels.zgemv as kz

    dense, compressed = _compressed_pair()
    calls = []
    real = kz.zgemv
    monkeypatch.setattr(kz, "zgemv", lambda x, zw, **config: calls.append(tuple(zw.shape)) or real(x, zw, **config))
    reference, engine = DecodeEngine(dense, max_len=32), DecodeEngine(compressed, max_len=32, zgemv=True)
    linears = sum(type(m) is ZgemvLinear for m in compressed.modules())
    assert engine.fused_groups == 2 and engine.zgemv_matrices == 2 + linears and linears >= 2  # o, down (+ lm_head)
    want_tokens, want = _decode_logits(reference, PROMPT, 8)
    engine.prefill(PROMPT)
    assert calls == [(64, 64)]  # 10 rows took the compressed path; the lm_head sees only the last row
    calls.clear()
    tokens, got = _decode_logits(engine, PROMPT, 8)
    assert tokens == want_tokens
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)  # fp32 sums of the same bf16 weights
    per_step = 2 + linears  # QKV, gate/up, o, down (, lm_head)
    assert len(calls) == 1 + 8 * per_step and (96 * 2, 64) in calls and (64 + 2 * 32, 64) in calls


def test_attach_converts_exactly_skips_stale_weights_and_detaches():
    from neutrain.compress import compress

    _, compressed = _compressed_pair(seed=4)
    count = attach_zgemv(compressed)
    assert count == len(compressed._neutrain_zgemv) and count >= 2
    down = compressed.model.layers[0].mlp.down_proj
    assert isinstance(down, ZgemvLinear)
    attached = down._neutrain_zgemv
    assert torch.equal(attached.zw.to_bf16().view(torch.int16), down.compressed.dense().view(torch.int16))
    x = torch.randn(1, 96).bfloat16()
    attached.active = True
    with torch.no_grad():
        assert attached.usable(x) and not attached.usable(torch.randn(9, 96).bfloat16())  # 9 rows: a prefill
        down.compressed.ct = compress(torch.zeros(64, 96).bfloat16())
        down.compressed.version += 1  # as an optimizer's write does
        assert not attached.usable(x)  # never the stale matrix: the compressed path, which sees the update
        assert torch.equal(down(x), torch.zeros(1, 64).bfloat16())
    assert detach_zgemv(compressed) == count
    assert type(down) is CompressedLinear and not hasattr(compressed, "_neutrain_zgemv")
