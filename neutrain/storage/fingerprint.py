"""A model's identity by its content: what a LoRA adapter records of the base it was trained on.

Why: ``neutrain export LORA_CKPT --base OTHER`` merged the adapters onto any model it was given, even one with
another vocabulary and tokenizer (the export then generated garbage), and recorded no base. An adapter is
only meaningful on the weights it was trained against, so its run records the base's fingerprint and a merge
compares it with the base it is given.

The fingerprint of a directory neutrain wrote (a checkpoint or an export: it has a manifest) is the sha256
of its manifest, which names every file's sha256, so it is exact. For another model (a Hugging Face
directory, a GGUF file) it is the sha256 of its config and tokenizer files whole, and of each weight
file's size and 64 samples of 4 KiB spread over it: reading a 140 GB model in full at every export would
take minutes, and two different trainings of one architecture differ in every sampled block. A file
edited in a few bytes between the samples is not told apart; the manifest case has no such limit.

Example:
    >>> import tempfile
    >>> a = tempfile.mkdtemp()
    >>> _ = open(f"{a}/config.json", "w").write("{}")
    >>> model_fingerprint(a) == model_fingerprint(a)
    True
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from neutrain.errors import UserInputError
from neutrain.files import MAX_FOLDER_TEXT_BYTES, read_bytes
from neutrain.storage.manifest import MANIFEST, content_hash

_SAMPLES, _BLOCK = 64, 4096
WHOLE = ("config.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "merges.txt")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _sampled(path: Path, digest) -> None:
    size = path.stat().st_size
    digest.update(f"{path.name}:{size}".encode())
    with open(path, "rb") as fh:
        for i in range(_SAMPLES):
            fh.seek(size * i // _SAMPLES)
            digest.update(fh.read(_BLOCK))


def model_fingerprint(path: str | os.PathLike) -> str:
    """``"manifest:<sha256>"`` for a model neutrain wrote, else ``"sampled:<sha256>"`` (see the module doc)."""
    path = Path(path)
    if path.is_dir() and (path / MANIFEST).is_file():
        return f"manifest:{content_hash(path)}"
    digest = hashlib.sha256()
    if path.is_file():
        _sampled(path, digest)
        return f"sampled:{digest.hexdigest()}"
    for name in WHOLE:
        # Read whole, so through the bounded reader: one too large to be a config or a vocabulary, a FIFO (which
        # would block the read) or a device (/dev/zero: read until memory ran out) is refused, never read, and
        # not left out of the fingerprint either, which would let it stand for a model without that file.
        if os.path.lexists(path / name):
            data = read_bytes(path / name, f"model file '{path / name}'", MAX_FOLDER_TEXT_BYTES, UserInputError)
            digest.update(name.encode() + b"\0" + data)
    for file in sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()):
        _sampled(file, digest)
    return f"sampled:{digest.hexdigest()}"
