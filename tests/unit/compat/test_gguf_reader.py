"""The GGUF readers neutrain answers for (``gguf.GGUFReader``, transformers' metadata reader) read a file
as they would themselves: the header parsed once gives the same fields, tensors and metadata."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from neutrain.compat.gguf_reader import gguf_reader, reading_from  # noqa: E402
from neutrain.storage.gguf_header import read_gguf  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.gguf_writer import tiny_llama, tiny_tokenizer, write_gguf

    tok = tiny_tokenizer()
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tiny_llama(len(tok)), tok, tensor_type="Q8_0")


def test_the_parsed_header_reads_as_the_gguf_package_reads_the_file(tiny):
    real, ours = gguf.GGUFReader(str(tiny)), gguf_reader(read_gguf(tiny))

    def values(field):
        string = field.types[-1] == gguf.GGUFValueType.STRING
        return [bytes(field.parts[i]) if string else field.parts[i].tolist() for i in field.data]

    assert list(ours.fields) == list(real.fields)
    for key, field in real.fields.items():
        assert ours.fields[key].types == field.types and values(ours.fields[key]) == values(field), key
    assert ours.data_offset == real.data_offset
    for mine, theirs in zip(ours.tensors, real.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.n_bytes, mine.data_offset, mine.shape.tolist()) == \
               (theirs.name, theirs.tensor_type, theirs.n_bytes, theirs.data_offset, theirs.shape.tolist())
        assert mine.data.dtype == theirs.data.dtype and np.array_equal(mine.data, theirs.data)


@pytest.mark.skipif(importlib.util.find_spec("transformers.integrations.gguf") is None,
                    reason="transformers 5.24's own GGUF metadata reader is not in this release")
def test_the_parsed_header_reads_as_transformers_reads_the_metadata(tiny):
    from transformers.integrations.gguf import reader

    wanted = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
    theirs = reader.read_gguf_metadata(str(tiny), wanted), reader.read_gguf_metadata(str(tiny))
    with reading_from(read_gguf(tiny)):
        ours = reader.read_gguf_metadata(str(tiny), wanted), reader.read_gguf_metadata(str(tiny))
    assert ours == theirs


def test_only_the_files_own_readers_are_answered(tiny, tmp_path):
    other = tmp_path / "other.gguf"
    other.write_bytes(tiny.read_bytes())
    real = gguf.GGUFReader
    with reading_from(read_gguf(tiny)):
        assert type(gguf.GGUFReader(str(tiny))).__name__ == "_Reader"
        assert type(gguf.GGUFReader(str(other))) is real
    assert gguf.GGUFReader is real and gguf.gguf_reader.GGUFReader is real  # nothing left patched
