"""A checkpoint's sha256 are taken as it is written, and its manifest is the one a read-back gives, byte for byte.

Before: the manifest read every file back and hashed it on the writing thread (an 89 GiB 70B checkpoint, twice
over per byte), and each check read the file and hashed it without overlapping the reads.
"""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch

from neutrain.errors import CheckpointError
from neutrain.nn.weight_offload_model import write_safetensors
from neutrain.storage import digests, manifest
from neutrain.storage.manifest import MANIFEST, verify_checkpoint, write_manifest


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"big.stream": torch.randint(-2**31, 2**31 - 1, (70_000,), dtype=torch.int32, generator=g),
            "big.tails": torch.randint(0, 255, (50_001,), dtype=torch.uint8, generator=g),
            "empty": torch.zeros(0, dtype=torch.uint8),
            "norm": torch.randn(33, generator=g).bfloat16(),
            "scale": torch.randn(3, 5, generator=g)}


def _read_back(path) -> tuple[str, dict[str, str]]:
    """The oracle: sha256 of the file's bytes and of each tensor's byte range, from the file itself."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    start = 8 + length
    tensors = {name: hashlib.sha256(data[start + info["data_offsets"][0]:start + info["data_offsets"][1]]).hexdigest()
               for name, info in header.items() if name != "__metadata__"}
    return hashlib.sha256(data).hexdigest(), tensors


def _entry_oracle(path) -> tuple[str, dict[str, str]]:
    """What a tiled safetensors file's manifest entry holds: its header's sha256 (up to the data) and its tensors'."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return hashlib.sha256(data[:8 + length]).hexdigest(), _read_back(path)[1]


@pytest.fixture()
def small_blocks(monkeypatch):
    # Blocks and the in-flight bound far below a tensor's size: the chunked, bounded paths are the ones run.
    monkeypatch.setattr(digests, "BLOCK", 4096)
    monkeypatch.setattr(digests, "IN_FLIGHT", 10_000)


def test_the_written_file_is_not_read_back_and_its_manifest_is_the_read_back_ones_byte_for_byte(tmp_path, monkeypatch,
                                                                                                small_blocks):
    write_safetensors(_tensors(), tmp_path / "model.safetensors", {"format": "neuzip-blobs"})
    (tmp_path / "config.json").write_text("{}")
    read = manifest._digests

    def no_read_back(path):
        assert path.suffix != ".safetensors", f"{path} was read back to be hashed"
        return read(path)

    monkeypatch.setattr(manifest, "_digests", no_read_back)
    written = write_manifest(tmp_path).read_bytes()
    monkeypatch.setattr(manifest, "_digests", read)

    digests.forget_all()
    assert write_manifest(tmp_path).read_bytes() == written  # the old path: every file read and hashed
    entry = json.loads(written)["files"]["model.safetensors"]
    assert (entry["header_sha256"], entry["tensors"]) == _entry_oracle(tmp_path / "model.safetensors")
    assert manifest._digests(tmp_path / "model.safetensors") == _read_back(tmp_path / "model.safetensors")
    verify_checkpoint(tmp_path)


@pytest.mark.parametrize("where", ["big.stream", "norm", "header"])
def test_a_flipped_byte_is_still_caught_and_named(tmp_path, small_blocks, where):
    path = tmp_path / "model.safetensors"
    write_safetensors(_tensors(), path, {"format": "neuzip-blobs"})
    write_manifest(tmp_path)
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    at = data.index(b"neuzip-blobs") if where == "header" else 8 + length + header[where]["data_offsets"][0] + 1
    data[at] ^= 0x20
    path.write_bytes(bytes(data))
    named = "in its header" if where == "header" else f"in tensor '{where}'"
    with pytest.raises(CheckpointError, match=f"fails its sha256 checksum {named}"):
        verify_checkpoint(tmp_path)


def test_a_file_changed_after_it_was_written_is_read_for_its_manifest(tmp_path, small_blocks):
    path = tmp_path / "model.safetensors"
    write_safetensors(_tensors(), path, {"format": "neuzip-blobs"})
    # Another size: a rewrite within the file system's timestamp tick would otherwise look unchanged.
    changed = {**_tensors(), "norm": torch.ones(34, dtype=torch.bfloat16)}
    from safetensors.torch import save_file

    save_file(changed, str(path), {"format": "neuzip-blobs"})  # another writer: nothing remembered for it
    entry = json.loads(write_manifest(tmp_path).read_text())["files"]["model.safetensors"]
    assert (entry["header_sha256"], entry["tensors"]) == _entry_oracle(path)
    verify_checkpoint(tmp_path)


def test_a_file_that_shrinks_while_it_is_read_is_one_line(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    write_safetensors(_tensors(), path, {})
    start, header = manifest.safetensors_header(path)
    monkeypatch.setattr(manifest, "safetensors_header", lambda p: (start, header))
    path.write_bytes(path.read_bytes()[:start + 100])
    with pytest.raises(CheckpointError, match="is truncated"):
        manifest._digests(path)
