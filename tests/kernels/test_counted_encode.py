"""The encode's count pass done inside the fused update (neutrain.compress.counted): the same bytes.

On CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1); whatever the
interpreter's float rounding, both encodes encode the same updated tensor, so their bytes must
match. The ``gpu`` tests train through LOMO and compare against the two-pass encode at full size.
"""

import pytest
import torch

from neutrain.compress import compress, counted, stream as kstream
from tests.helpers import assert_same_format as _assert_same_format

kcodec = pytest.importorskip("neutrain.kernels.codec")
kfu = pytest.importorskip("neutrain.kernels.fused_update")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = "auto" if DEVICE == "cuda" else "triton"


def _geometry(shape):
    return {"steps": 4, "lanes": 16} if DEVICE == "cpu" else {}


def _pair(shape):
    """A weight and two compressed copies with the most headroom a tensor earns (1/32): the updates
    here are far larger than training's, and a fresh stream's 1/2048 would overflow (that path has
    its own tests in test_codec.py)."""
    x = torch.randn(*shape, device=DEVICE).mul(0.02).bfloat16()
    pair = [compress(x, backend=BACKEND, **_geometry(shape)) for _ in range(2)]
    for ct in pair:
        ct._headroom_shift = kstream.MIN_HEADROOM_SHIFT
        kstream.grow(ct, ct.stream_words, earned=False)
    return x, *pair


def _update(ct, w, g, chunk_starts):
    """The fused update of ``w`` in row-major chunks starting at ``chunk_starts``, counting into ``ct``."""
    count = counted.begin(ct, w, backend=BACKEND)
    assert count is not None
    flat_w, flat_g = w.view(-1), g.view(-1)
    ends = list(chunk_starts[1:]) + [w.numel()]
    for start, end in zip(chunk_starts, ends):
        kfu.fused_update_(flat_w[start:end], flat_g[start:end], lr=0.02, ok=torch.tensor(True, device=DEVICE),
                          seed=3, base=start, count=count)
    return count


@pytest.mark.parametrize("shape, chunk_starts", [((37, 29), [0]), ((37, 29), [0, 290, 777]), ((64, 64), [0, 1024])])
def test_counted_encode_writes_the_two_pass_encodes_bytes(shape, chunk_starts):
    """Chunks at multiples of 4 and not (290 = 4 * 72 + 2: one atomic per element there), a partial
    last lane (37 * 29 is odd), several tiles."""
    x, ct, twin = _pair(shape)
    w = x.clone()
    g = torch.randn(shape, device=DEVICE).mul(0.05).bfloat16()
    _, lane_bits, _ = _update(ct, w, g, chunk_starts)
    before = dict(kcodec.COUNTERS)
    ct.recompress_(w, backend=BACKEND, sync=False)
    assert kcodec.COUNTERS["count_fused"] == before["count_fused"] + 1
    assert kcodec.COUNTERS["count"] == before["count"]  # the weight was read once
    assert not torch.any(lane_bits)  # zero again for the next update
    twin.recompress_(w.clone(), backend=BACKEND, sync=False)
    assert not torch.equal(w, x) and ct.rebuilds == twin.rebuilds == 0
    _assert_same_format(ct, twin)
    assert torch.equal(ct.decompress(backend=BACKEND).view(torch.int16), w.view(torch.int16))


def test_counts_of_other_values_never_reach_an_encode():
    x, ct, twin = _pair((37, 29))
    w = x.clone()
    g = torch.randn_like(x.float()).mul(0.05).bfloat16()
    lane_bits = _update(ct, w, g, [0])[1]
    w.mul_(1.01)  # written after the count (torch's version counter moves): the counts are stale
    before = dict(kcodec.COUNTERS)
    ct.recompress_(w, backend=BACKEND, sync=False)
    assert kcodec.COUNTERS["count_fused"] == before["count_fused"]
    assert not torch.any(lane_bits)  # the stale counts were cleared, not added to
    twin.recompress_(w.clone(), backend=BACKEND, sync=False)
    _assert_same_format(ct, twin)
    # Counted for one tensor, then another tensor is encoded: the counts go, the other encode counts itself.
    y, other, other_twin = _pair((37, 29))
    _update(ct, w, g, [0])
    other.recompress_(y.mul(1.01), backend=BACKEND, sync=False)
    other_twin.recompress_(y.mul(1.01), backend=BACKEND, sync=False)
    _assert_same_format(other, other_twin)
    assert not torch.any(lane_bits)


def test_a_synchronous_encode_counts_again_and_clears_the_counts():
    x, ct, twin = _pair((37, 29))
    w = x.clone()
    g = torch.randn_like(x.float()).mul(0.05).bfloat16()
    lane_bits = _update(ct, w, g, [0])[1]
    ct.recompress_(w, backend=BACKEND, sync=True)
    assert not torch.any(lane_bits)
    twin.recompress_(w.clone(), backend=BACKEND, sync=True)
    _assert_same_format(ct, twin)


def test_only_the_kernel_path_of_lossless_bf16_counts():
    x = torch.randn(8, 8, device=DEVICE).bfloat16()
    assert counted.begin(compress(x, 3, backend=BACKEND), x, backend=BACKEND) is None  # lossy
    assert counted.begin(compress(x, backend="reference"), x, backend="reference") is None
    assert counted.begin(compress(x, backend=BACKEND), x[:4], backend=BACKEND) is None  # not the whole tensor


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("shape, chunk_starts", [((2048, 14336), [0, 1170 * 14336]),  # down_proj's row chunks
                                                 ((1024, 4099), [0, 7 * 4099, 300 * 4099])])  # starts not % 4
def test_counted_encode_at_full_size_on_gpu(shape, chunk_starts):
    test_counted_encode_writes_the_two_pass_encodes_bytes(shape, chunk_starts)


@pytest.mark.gpu
def test_lomo_on_compressed_weights_counts_in_the_update_and_equals_dense_on_gpu(monkeypatch):
    """Compressed + fused LOMO (counting inside the update) equals dense + fused LOMO bit for bit,
    and the re-encodes of the trained matrices took the counts instead of their own count pass."""
    import copy

    from transformers import AutoModelForCausalLM, LlamaConfig

    from neutrain.nn import compress_model
    from neutrain.optim import LOMO
    from tests.unit.nn.nn_helpers import token_batches, train, weights

    monkeypatch.setattr(counted, "IN_UPDATE", True)  # off by default: it measured slower (counted.py)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=512)
    dense = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().train()
    compressed = copy.deepcopy(dense)
    compress_model(compressed, progress=False)
    data = [ids.cuda() for ids in token_batches(3, batch=4, length=64)]
    train(dense, LOMO(dense.parameters(), lr=5e-2, seed=2, clip_mode="per_tensor", max_grad_norm=1.0), data)
    before = dict(kcodec.COUNTERS)
    train(compressed, LOMO(compressed.parameters(), lr=5e-2, seed=2, clip_mode="per_tensor", max_grad_norm=1.0),
          data)
    a, b = weights(dense), weights(compressed)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    fused = kcodec.COUNTERS["count_fused"] - before["count_fused"]
    two_pass = kcodec.COUNTERS["count"] - before["count"]  # synchronous encodes (code rebuilds) count again
    assert fused >= 2 * 7 + 2 and fused > two_pass, (fused, two_pass)  # at least a step's matrices
