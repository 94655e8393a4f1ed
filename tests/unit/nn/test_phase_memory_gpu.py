"""Issue 27 on CUDA: each phase's peak beyond the resident model, from the CUDA allocator, on a model of
4 layers, hidden 1024, vocab 32000 (largest matrix: the 62.5 MiB embedding and lm_head).

Build, save, resume and export go tensor by tensor: none may add more than a few matrices' dense bytes
to the resident model (the codec's encode and decode scratch included). Each test prints its figure in
units of the largest matrix, for benchmarks/notes_cards.md.
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
# Beyond the resident model, in largest dense matrices: the codec's encode scratch during the build; one
# decoded matrix plus its decode scratch for the dense export; one new compressed matrix while resuming.
BUILD, SAVE, RESUME, EXPORT = 3.0, 0.25, 1.5, 2.5


def _build(seed=0):
    return init_compressed(CONFIG, device="cuda", progress=False, seed=seed)[0]


def _report(phase, peak, largest):
    print(f"{phase}: {peak / 2**20:.1f} MiB beyond the resident model = {peak / largest:.2f} largest matrices")


def test_build_adds_at_most_a_few_matrices_to_the_model():
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    model, peak = cuda_peak(_build)
    resident = torch.cuda.memory_allocated() - before  # the model itself, which is not scratch
    largest = largest_matrix_bytes(model)
    _report("build", peak - resident, largest)
    assert peak - resident <= BUILD * largest


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
    _, peak = cuda_peak(save_compressed_checkpoint, model, tmp_path / "ckpt", "neuzip-lossless")
    _report("save", peak, largest)
    assert peak <= SAVE * largest

    other = _build(seed=1)
    del model
    torch.cuda.empty_cache()
    _, peak = cuda_peak(load_compressed_state, other, tmp_path / "ckpt")
    _report("resume", peak, largest)
    assert peak <= RESUME * largest

    for fmt in ("neuzip", "hf"):
        _, peak = cuda_peak(export_model, other, tmp_path / fmt, fmt)
        _report(f"export {fmt}", peak, largest)
        assert peak <= (SAVE if fmt == "neuzip" else EXPORT) * largest, fmt
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
