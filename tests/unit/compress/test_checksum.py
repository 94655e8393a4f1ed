"""The compressed tensors' checksum: the bounded, regrouped sums equal the definition, on any bytes."""

import pytest
import torch

from neutrain.compress import checksum as ck
from neutrain.compress.checksum import checksum, checksum_reference


@pytest.mark.parametrize("sizes", [[0], [1], [255, 256, 257], [70_001, 3],
                                   pytest.param([(1 << 24) + 300, 999], marks=pytest.mark.slow)])  # 16 MiB: seconds
def test_checksum_equals_its_definition_on_fresh_random_bytes(sizes):
    blobs = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
    assert torch.equal(checksum(blobs), checksum_reference(blobs))


@pytest.mark.slow
def test_checksum_is_exact_at_the_largest_row_sums():
    """All-255 bytes maximise every fp32 row sum: one rounding there would change the result."""
    blobs = [torch.full(((1 << 24) + 513,), 255, dtype=torch.uint8), torch.full((77,), 254, dtype=torch.int16)]
    assert torch.equal(checksum(blobs), checksum_reference(blobs))


def test_checksum_scratch_is_bounded_by_a_chunk(monkeypatch):
    """The sums see one chunk at a time, never the tensor whole (a whole-tensor pass once ran a card out of memory)."""
    seen = []
    real = ck._sums_numpy
    monkeypatch.setattr(ck, "_sums_numpy", lambda chunk: seen.append(chunk.size) or real(chunk))
    monkeypatch.setattr(ck, "_CHUNK", 4096)
    data = torch.randint(0, 256, (3 * 4096 + 100,), dtype=torch.uint8)
    assert torch.equal(checksum([data]), checksum_reference([data]))
    assert max(seen) == 4096 and len(seen) == 4


def test_a_changed_byte_changes_the_checksum():
    data = torch.randint(0, 256, (100_000,), dtype=torch.uint8)
    before = checksum([data])
    data[54_321] ^= 1
    assert not torch.equal(before, checksum([data]))


@pytest.mark.gpu
def test_checksum_on_cuda_and_of_large_host_blobs_through_cuda_equals_the_definition():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; run on the device machine")
    host = torch.randint(0, 256, (ck._VIA_GPU + 12_345,), dtype=torch.uint8)  # summed on the GPU
    device = torch.randint(0, 256, ((1 << 24) + 7,), dtype=torch.uint8, device="cuda")
    assert torch.equal(checksum([host, device]), checksum_reference([host, device.cpu()]))
    worst = torch.full(((1 << 24) + 513,), 255, dtype=torch.uint8, device="cuda")
    assert torch.equal(checksum([worst]), checksum_reference([worst.cpu()]))
