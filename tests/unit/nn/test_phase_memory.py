"""Every phase goes tensor by tensor: build, save, resume and export never hold a second
copy of the model, only scratch of about one matrix. Measured on the CPU allocator (the CPU plays the
device); tests/unit/nn/test_phase_memory_gpu.py makes the same checks on CUDA."""

import os

import pytest
import torch
from transformers import LlamaConfig

import neutrain.nn.load as load
import neutrain.nn.sources as sources
from neutrain.compress.checksum import checksum
from neutrain.nn.checkpoint import WEIGHTS_FILE, load_compressed_state, save_compressed_checkpoint
from neutrain.nn.convert import decompressed_state_dict

from .phase_peaks import host_peak, largest_matrix_bytes

CODEC = {"steps": 16}
# Eight layers: the compressed model is about eight times its largest matrix (the 512 x 64 embedding and
# lm_head), so a second copy of the model stands far above one matrix's scratch.
CONFIG = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512, max_position_embeddings=64, tie_word_embeddings=False)


def _build(seed=0, weights="neuzip-lossless"):
    return load.init_compressed(CONFIG, weights, "cpu", progress=False, codec_options=CODEC, seed=seed)[0]


def test_random_init_draws_no_fp32_copy_of_a_matrix(monkeypatch):
    # Dense weights isolate the initialisation (the codec's own scratch is another matter). It once drew
    # each matrix whole in fp32 and kept that copy beside the bf16 one: two extra matrices at its peak.
    monkeypatch.setattr(sources, "_INIT_BLOCK_ELEMENTS", 512 * 64 // 8, raising=False)
    model, peak = host_peak(lambda: None, lambda _: _build(weights="dense"))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = largest_matrix_bytes(model)
    assert peak - model_bytes <= largest // 2, (peak - model_bytes) / largest


def test_blocked_random_init_is_bit_identical_to_one_fp32_draw():
    shapes = [(512, 64), (100, 17), (333, 48), (7, 100, 24), (65, 16), (5, 3), (3, 0)]
    for block in (64, 1000, 1 << 22):
        for shape in shapes:
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                sources._INIT_BLOCK_ELEMENTS, saved = block, sources._INIT_BLOCK_ELEMENTS
                try:
                    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
                    expected = torch.empty(shape).normal_(0.0, 0.02, generator=g1).to(dtype)
                    got = sources.random_normal(shape, 0.02, dtype, "cpu", g2)
                finally:
                    sources._INIT_BLOCK_ELEMENTS = saved
                assert torch.equal(got, expected), (block, shape, dtype)
                # the generator is left where one draw leaves it: the next matrix is the same too
                assert torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2)), (block, shape, dtype)


@pytest.mark.slow
def test_saving_a_checkpoint_copies_no_blob(tmp_path):
    # It once cloned every blob (model.state_dict()) and built the whole file in memory (save_file).
    model, peak = host_peak(_build, lambda m: (save_compressed_checkpoint(m, tmp_path, "neuzip-lossless"), m)[1])
    assert peak <= largest_matrix_bytes(model) // 4, peak / largest_matrix_bytes(model)


@pytest.mark.slow
def test_resuming_loads_one_weight_at_a_time_and_exactly(tmp_path):
    trained = _build(seed=0)
    save_compressed_checkpoint(trained, tmp_path, "neuzip-lossless")
    size = os.path.getsize(tmp_path / WEIGHTS_FILE)
    # It once read every tensor of the file, then moved the whole dict to the model's device at once.
    model, peak = host_peak(lambda: _build(seed=1), lambda m: (load_compressed_state(m, tmp_path), m)[1],
                            ignore_sizes=(size,))
    assert peak <= largest_matrix_bytes(model), peak / largest_matrix_bytes(model)
    expected, got = decompressed_state_dict(trained), decompressed_state_dict(model)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.slow
def test_neuzip_export_copies_no_blob_and_decodes_to_the_trained_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    from neutrain.export.neuzip import export_neuzip

    model, peak = host_peak(_build, lambda m: (export_neuzip(m, tmp_path / "export"), m)[1])
    assert peak <= largest_matrix_bytes(model) // 4, peak / largest_matrix_bytes(model)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    expected, got = decompressed_state_dict(model), decompressed_state_dict(loaded)
    assert all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.parametrize("chunk", [256, 1000, 1 << 24])
def test_checksum_is_the_defined_sums_in_any_chunking(monkeypatch, chunk):
    """The stored checksum is ``sum(b_i)`` and ``sum((i + 1) b_i)`` mod ``2**31 - 1``: the row/column form,
    in numpy or in torch, gives the values every existing checkpoint holds."""
    import neutrain.compress.checksum as ck

    monkeypatch.setattr(ck, "_CHUNK", chunk)
    g = torch.Generator().manual_seed(0)
    blobs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (0, 1, 255, 256, 257, 5000)]
    blobs += [torch.randint(-2**31, 2**31 - 1, (777,), dtype=torch.int32, generator=g), torch.arange(9)]
    data = torch.cat([b.reshape(-1).view(torch.uint8) for b in blobs]).to(torch.int64)
    prime = (1 << 31) - 1
    index = torch.arange(1, data.numel() + 1)
    expected = [int(data.sum()) % prime, int(((index % prime) * data % prime).sum()) % prime]
    assert checksum(blobs).tolist() == expected
    monkeypatch.setattr(ck, "_sums_numpy", lambda c: ck._sums_torch(torch.from_numpy(c)), raising=False)
    assert checksum(blobs).tolist() == expected
