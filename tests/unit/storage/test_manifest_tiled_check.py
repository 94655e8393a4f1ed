"""A safetensors file is checked by its header's digest and its tensors' (on threads), not by one serial sha256
of the whole file, and every byte is still covered.

Why: the file's sha256 is one pass on one core (about 1 GB/s): a 70B's 89 GiB checkpoint spent ~100 s of each
resume, export and generate on it, while the tensors' digests, spread over threads, read at the disk's rate.
The manifest now records the header's digest beside them; a file whose tensors leave bytes uncovered, or an
entry written before (no header digest), is checked by the whole file's sha256 as before.
"""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neutrain.errors import CheckpointError
from neutrain.nn.weight_offload_model import write_safetensors
from neutrain.storage import digests, manifest
from neutrain.storage.manifest import HEADER_DIGEST, MANIFEST, verify_checkpoint, write_manifest


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"a.stream": torch.randint(-2**31, 2**31 - 1, (3_000,), dtype=torch.int32, generator=g),
            "a.tails": torch.randint(0, 255, (1_001,), dtype=torch.uint8, generator=g),
            "empty": torch.zeros(0, dtype=torch.uint8),
            "norm": torch.randn(17, generator=g).bfloat16()}


def _gapped(path) -> None:
    """A safetensors file whose two tensors leave 4 bytes between them (the format allows it)."""
    header = json.dumps({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                         "b": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(range(1, 13)))


@pytest.fixture()
def written(tmp_path):
    write_safetensors(_tensors(), tmp_path / "model.safetensors", {"format": "neuzip-blobs"})
    (tmp_path / "config.json").write_text("{}")
    write_manifest(tmp_path)
    return tmp_path


def test_the_manifest_records_the_headers_digest(written):
    entry = json.loads((written / MANIFEST).read_text())["files"]["model.safetensors"]
    data = (written / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    assert "sha256" not in entry  # no serial pass over the file, written or checked
    assert entry[HEADER_DIGEST] == hashlib.sha256(data[:8 + length]).hexdigest()


def test_the_check_takes_no_serial_pass_over_a_tiled_file(written, monkeypatch):
    calls = []
    real = manifest.file_digests

    def spy(path, spans, whole=True):
        calls.append((path.name, whole))
        return real(path, spans, whole)

    monkeypatch.setattr(manifest, "file_digests", spy)
    verify_checkpoint(written)
    assert ("model.safetensors", False) in calls and ("model.safetensors", True) not in calls


def test_a_gapped_file_and_an_older_entry_take_the_whole_files_sha256(tmp_path, monkeypatch):
    _gapped(tmp_path / "model.safetensors")
    write_manifest(tmp_path)
    assert HEADER_DIGEST not in json.loads((tmp_path / MANIFEST).read_text())["files"]["model.safetensors"]
    calls = []
    real = manifest.file_digests
    monkeypatch.setattr(manifest, "file_digests", lambda p, s, whole=True: calls.append(whole) or real(p, s, whole))
    verify_checkpoint(tmp_path)
    assert calls == [True]
    data = bytearray((tmp_path / "model.safetensors").read_bytes())
    data[-7] ^= 1  # a byte between the tensors: no tensor's digest holds it, the file's does
    (tmp_path / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="fails its sha256 checksum"):
        verify_checkpoint(tmp_path)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(at=st.floats(min_value=0.0, max_value=1.0, exclude_max=True), bit=st.integers(0, 7),
       old_entry=st.booleans(), small=st.booleans())
def test_any_flipped_bit_anywhere_is_refused_naming_the_file(tmp_path_factory, monkeypatch, at, bit, old_entry, small):
    """Every byte of the file (length, header, each tensor, the last byte) is covered, by either check."""
    if small:  # the chunked, bounded reading paths
        monkeypatch.setattr(digests, "BLOCK", 4096)
        monkeypatch.setattr(digests, "IN_FLIGHT", 10_000)
    folder = tmp_path_factory.mktemp("ckpt")
    path = folder / "model.safetensors"
    write_safetensors(_tensors(), path, {"format": "neuzip-blobs"})
    write_manifest(folder)
    verify_checkpoint(folder)
    if old_entry:  # a manifest an earlier neutrain wrote: the file's sha256, no header digest
        record = json.loads((folder / MANIFEST).read_text())
        entry = record["files"]["model.safetensors"]
        del entry[HEADER_DIGEST]
        entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        (folder / MANIFEST).write_text(json.dumps(record))
        verify_checkpoint(folder)
    data = bytearray(path.read_bytes())
    data[int(at * len(data))] ^= 1 << bit
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        verify_checkpoint(folder)
