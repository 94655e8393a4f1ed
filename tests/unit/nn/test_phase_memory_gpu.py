"""Each phase's CUDA peak beyond the resident model, on a model of 4 layers, hidden 1024, vocab 32000
(largest matrix: the 62.5 MiB embedding and lm_head).

Build, save, resume and export go tensor by tensor. The limits are stated against what one tensor's work
costs when it runs alone on the same card, measured in the same test, not as guessed multiples of a
matrix: on a model this small the codec's and the checksum's fixed scratch (the encoder's per-lane tables,
the checksum's 4 MiB chunk upcast to int64 by torch's reductions) is several matrices, while on the 8B it
is a small fraction of one. "Tensor by tensor" then means: a phase never holds more than the costliest
single tensor's work at once. Each test prints its figures in largest matrices, for
benchmarks/cards/NOTES.md.
"""

import os

import pytest
import torch
from transformers import LlamaConfig

from neutrain.nn.checkpoint import load_compressed_state, save_compressed_checkpoint
from neutrain.nn.convert import decompressed_state_dict
from neutrain.nn.load import init_compressed
from neutrain.nn.sources import random_normal

from .phase_peaks import cuda_peak, largest_matrix_bytes

pytestmark = pytest.mark.gpu

CONFIG = LlamaConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
                     num_key_value_heads=4, vocab_size=32000, max_position_embeddings=256, tie_word_embeddings=False)
# Beyond the resident model, in largest dense matrices: one decoded matrix plus its decode scratch for the
# dense export; one new compressed matrix (about 0.7 of a dense one) while resuming. Both held on an H200.
RESUME, EXPORT = 1.5, 2.5
SLACK = 1.05, 2 << 20  # allocator rounding: 5% and 2 MiB over the one-tensor reference


def _one_tensor_limit(reference: int) -> int:
    return int(reference * SLACK[0]) + SLACK[1]


def _largest_blob_checksum_peak(model) -> int:
    """CUDA scratch of the checksum of the model's largest stored blob, alone (what a save holds at once)."""
    from neutrain.compress.checksum import checksum
    from neutrain.nn import compressed_weights

    blobs = [t for w in compressed_weights(model) for t in w.ct.state_dict().values() if isinstance(t, torch.Tensor)]
    largest = max(blobs, key=lambda t: t.numel() * t.element_size())
    return cuda_peak(checksum, [largest])[1]


def _build(seed=0):
    return init_compressed(CONFIG, device="cuda", progress=False, seed=seed)[0]


def _report(phase, peak, largest):
    print(f"{phase}: {peak / 2**20:.1f} MiB beyond the resident model = {peak / largest:.2f} largest matrices")


def test_build_holds_one_matrix_encode_at_a_time():
    from neutrain.compress import compress

    shape = (CONFIG.vocab_size, CONFIG.hidden_size)  # the largest matrix

    def encode_one():  # draw and encode the largest matrix alone: what one step of the build holds
        dense = random_normal(shape, 0.02, torch.bfloat16, "cuda", torch.Generator(device="cuda").manual_seed(0))
        return compress(dense, name="embed")

    torch.cuda.empty_cache()
    encoded, one = cuda_peak(encode_one)  # also warms the codec's one-time tables, which stay resident
    one -= encoded.nbytes if hasattr(encoded, "nbytes") else 0
    del encoded
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    model, peak = cuda_peak(_build)
    resident = torch.cuda.memory_allocated() - before  # the model itself, which is not scratch
    largest = largest_matrix_bytes(model)
    _report("build", peak - resident, largest)
    _report("encode of the largest matrix alone", one, largest)
    assert peak - resident <= _one_tensor_limit(one)


def test_random_init_on_cuda_draws_the_bits_of_an_fp32_draw():
    for shape in ((32000, 1024), (1000, 37), (4, 3, 100)):
        for dtype in (torch.bfloat16, torch.float16):
            g1 = torch.Generator(device="cuda").manual_seed(3)
            g2 = torch.Generator(device="cuda").manual_seed(3)
            expected = torch.empty(shape, device="cuda").normal_(0.0, 0.02, generator=g1).to(dtype)
            got, peak = cuda_peak(random_normal, shape, 0.02, dtype, "cuda", g2)
            assert torch.equal(got, expected), (shape, dtype)
            assert peak <= got.numel() * got.element_size() + (1 << 20), (shape, dtype, peak)  # no fp32 copy


def test_save_resume_and_export_stay_near_one_matrix(tmp_path):
    from neutrain.export import export_model

    model = _build(seed=0)
    largest = largest_matrix_bytes(model)
    one_checksum = _largest_blob_checksum_peak(model)
    _report("checksum of the largest blob alone", one_checksum, largest)
    _, peak = cuda_peak(save_compressed_checkpoint, model, tmp_path / "ckpt", "neuzip-lossless")
    _report("save", peak, largest)
    assert peak <= _one_tensor_limit(one_checksum)

    other = _build(seed=1)
    del model
    torch.cuda.empty_cache()
    _, peak = cuda_peak(load_compressed_state, other, tmp_path / "ckpt")
    _report("resume", peak, largest)
    assert peak <= RESUME * largest

    for fmt in ("neuzip", "hf"):
        _, peak = cuda_peak(export_model, other, tmp_path / fmt, fmt)
        _report(f"export {fmt}", peak, largest)
        assert peak <= (_one_tensor_limit(one_checksum) if fmt == "neuzip" else EXPORT * largest), fmt
    assert os.path.exists(tmp_path / "hf" / "config.json")


def test_resumed_model_is_bit_identical_on_cuda(tmp_path):
    model = _build(seed=0)
    save_compressed_checkpoint(model, tmp_path, "neuzip-lossless")
    other = _build(seed=1)
    load_compressed_state(other, tmp_path)
    expected, got = decompressed_state_dict(model, device="cpu"), decompressed_state_dict(other, device="cpu")
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


def test_device_checksum_matches_the_host_one():
    from neutrain.compress.checksum import checksum

    g = torch.Generator().manual_seed(0)
    blobs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (1, 257, (1 << 24) + 999)]
    blobs.append(torch.randint(-2**31, 2**31 - 1, (4097,), dtype=torch.int32, generator=g))
    assert checksum(b.cuda() for b in blobs).tolist() == checksum(blobs).tolist()
