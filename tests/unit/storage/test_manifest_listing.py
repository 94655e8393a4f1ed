"""A manifest vouches for every file of its directory: one it does not list is refused (generated file sets).

Before: only the files the manifest listed were checked, so deleting a file's entry (and flipping a bit in
it), or adding a file, loaded unchecked.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neutrain.errors import CheckpointError
from neutrain.storage.manifest import MANIFEST, verify_checkpoint, write_manifest

_NAMES = st.sampled_from(["config.json", "trainer_state.json", "notes.txt", "README.md", "sub/extra.json",
                          "tokenizer.json", "deep/er/x.json", "LICENSE"])


def _content(name: str, seed: int) -> bytes:
    return json.dumps({"name": name, "seed": seed}).encode() if name.endswith(".json") else f"text {seed}\n".encode()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(files=st.sets(_NAMES, min_size=1, max_size=6), seed=st.integers(0, 9),
       mutation=st.sampled_from(["none", "add", "unlist", "unlist-and-flip", "flip"]), pick=st.integers(0, 5),
       added=_NAMES)
def test_every_file_is_checked_listed_or_not(tmp_path_factory, files, seed, mutation, pick, added):
    root = tmp_path_factory.mktemp("ckpt")
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(_content(name, seed))
    write_manifest(root)
    victim = sorted(files)[pick % len(files)]
    if mutation == "add":
        if added in files:
            added = "new-" + added.replace("/", "-")
        (root / added).parent.mkdir(parents=True, exist_ok=True)
        (root / added).write_bytes(_content(added, seed + 1))
    if mutation in ("unlist", "unlist-and-flip"):
        manifest = json.loads((root / MANIFEST).read_text())
        del manifest["files"][victim]
        (root / MANIFEST).write_text(json.dumps(manifest))
    if mutation in ("flip", "unlist-and-flip"):
        data = bytearray((root / victim).read_bytes())
        data[len(data) // 2] ^= 0x01
        (root / victim).write_bytes(bytes(data))
    if mutation == "none":
        verify_checkpoint(root)
        return
    with pytest.raises(CheckpointError) as info:
        verify_checkpoint(root)
    expected = "not listed" if mutation != "flip" else "checksum"
    assert expected in str(info.value), (mutation, str(info.value))
