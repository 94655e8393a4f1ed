"""neutrain.storage.manifest on hand-made files: what passes, what is refused, and what the errors name."""

import json
import pickle
import random

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from neutrain.storage.manifest import MANIFEST, check_file, verify_checkpoint, write_manifest
from neutrain.errors import CheckpointError


def test_plain_files_pass_and_the_manifest_lists_every_tensor(tmp_path):
    save_file({"a": torch.ones(3), "b": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "sub").mkdir()
    torch.save({"state": {0: {"exp_avg": torch.ones(2)}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
               tmp_path / "sub" / "optimizer.pt")
    # The Trainer's RNG file holds numpy state: allowlisted as transformers loads it.
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()},
               tmp_path / "rng_state.pth")
    (tmp_path / "trainer_state.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    manifest = json.loads(write_manifest(tmp_path).read_text())
    assert sorted(manifest["files"]) == ["chat_template.jinja", "model.safetensors", "rng_state.pth",
                                         "sub/optimizer.pt", "trainer_state.json"]
    assert sorted(manifest["files"]["model.safetensors"]["tensors"]) == ["a", "b"]
    verify_checkpoint(tmp_path, required=("trainer_state.json",))


def test_legacy_torch_files_are_checked_too(tmp_path):
    torch.save({"x": torch.ones(2)}, tmp_path / "ok.pt", _use_new_zipfile_serialization=False)
    check_file(tmp_path / "ok.pt")
    with open(tmp_path / "bad.pt", "wb") as fh:
        pickle.dump({"x": print}, fh)  # a global outside the weights-only allowlist
    with pytest.raises(CheckpointError, match=r"bad\.pt' refused: it holds objects other than tensors"):
        check_file(tmp_path / "bad.pt")


@pytest.mark.parametrize("name,content,reason", [
    ("model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{}", "truncated"),
    ("model.safetensors", b"\x02\x00\x00\x00\x00\x00\x00\x00{}extra", "bytes after the last tensor"),
    ("model.safetensors", b"\x02\x00\x00\x00\x00\x00\x00\x00[]", "its header is a JSON list, not an object"),
    ("trainer_state.json", b'{"global_step": 1', "not valid JSON"),
    ("chat_template.jinja", b"\x80\x04", "not UTF-8"),
    (".metadata", b"\x80\x04N.", "refused"),
    ("__0_0.distcp", b"", "refused"),
    ("evil.pkl", b"\x80\x04N.", "refused"),
])
def test_malformed_or_unknown_files_are_refused_by_name(tmp_path, name, content, reason):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(CheckpointError, match=reason) as err:
        check_file(tmp_path / name)
    assert name in str(err.value)


def test_the_manifest_names_missing_resized_and_replaced_files(tmp_path):
    (tmp_path / "a.json").write_text("[1]")
    (tmp_path / "b.json").write_text("[2]")
    write_manifest(tmp_path)
    (tmp_path / "a.json").write_text("[3]")  # same size, other bytes
    with pytest.raises(CheckpointError, match=r"a\.json' fails its sha256 checksum"):
        verify_checkpoint(tmp_path)
    (tmp_path / "a.json").write_text("[1] ")
    with pytest.raises(CheckpointError, match=r"a\.json' has 4 bytes, 3 when it was written"):
        verify_checkpoint(tmp_path)
    (tmp_path / "a.json").unlink()
    with pytest.raises(CheckpointError, match=r"a\.json' is missing"):
        verify_checkpoint(tmp_path)
    verify_checkpoint(tmp_path, may_be_missing=("a.json",))
    (tmp_path / MANIFEST).write_text('{"files": 3}')
    with pytest.raises(CheckpointError, match="not a neutrain manifest"):
        verify_checkpoint(tmp_path)
