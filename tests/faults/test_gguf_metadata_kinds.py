"""A GGUF file's metadata values that a reader acts on are of the kind it takes, or the file is refused in one line
naming the file and the key, as its header is read (:mod:`neutrain.storage.gguf_metadata`): a ``block_count`` stored
as a string, a float or an array, a token id as a string, a chat template as a number, token types as strings or
merges as numbers were tracebacks from transformers or Jinja, and a ``token_type`` array shorter than the vocabulary
loaded and generated, exit 0."""

from __future__ import annotations

import struct

import pytest

from neutrain.cli import main
from neutrain.errors import CheckpointError
from neutrain.storage.gguf_header import read_gguf
from neutrain.storage.gguf_metadata import KINDS

TOKENS = ["a", "b", "ab", "<s>"]
# Values by their GGUF kind: (type code, element type or None, value).
VALUES = {
    "string": (8, None, "two"), "u32": (4, None, 2), "i64": (11, None, 2), "f32": (6, None, 2.5),
    "bool": (7, None, True), "ints": (9, 5, [1, 2, 3, 4]), "floats": (9, 6, [0.5, 0.5, 0.5, 0.5]),
    "strings": (9, 8, ["a b", "ab b", "a c", "b c"]), "short ints": (9, 5, [1, 2]),
    "bad merges": (9, 8, ["abc", "a  b", " a", "a b c"]),
}
# Which of VALUES each kind of KINDS takes: the oracle, written from the readers' side.
TAKES = {"string": {"string"}, "integer": {"u32", "i64"}, "integers": {"u32", "i64", "ints", "short ints"},
         "number": {"u32", "i64", "f32"}, "boolean": {"bool"}, "strings": {"strings", "bad merges"},
         "merges": {"strings"}, "per-token integers": {"ints"}, "per-token numbers": {"ints", "floats"}}
# A key of each pattern of the table.
SAMPLE_KEYS = {"general.architecture", "llama.context_length", "llama.block_count", "llama.embedding_length",
               "llama.feed_forward_length", "llama.attention.head_count_kv", "llama.attention.layer_norm_rms_epsilon",
               "llama.rope.freq_base", "llama.rope.scaling.type", "tokenizer.ggml.model", "tokenizer.chat_template",
               "tokenizer.chat_template.tool_use", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
               "tokenizer.ggml.token_type", "tokenizer.ggml.scores", "tokenizer.ggml.bos_token_id",
               "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token", "qwen2.vocab_size"}
_FORMATS = {4: "<I", 5: "<i", 6: "<f", 7: "<?", 11: "<q"}


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _value(code: int, inner: int | None, value) -> bytes:
    if code == 8:
        return _string(value)
    if code == 9:
        items = b"".join(_string(v) if inner == 8 else struct.pack(_FORMATS[inner], v) for v in value)
        return struct.pack("<IQ", inner, len(value)) + items
    return struct.pack(_FORMATS[code], value)


def _gguf(path, metadata: dict) -> None:
    """A GGUF v3 file of ``metadata`` (key -> (code, inner, value)) and no tensors."""
    body = b"".join(_string(k) + struct.pack("<I", code) + _value(code, inner, v)
                    for k, (code, inner, v) in metadata.items())
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(metadata)) + body)


def _kind(key: str) -> str:
    import re

    return next(kind for pattern, kind in KINDS if re.fullmatch(pattern, key))


def test_the_sample_keys_cover_every_row_of_the_table():
    import re

    assert {pattern for pattern, _ in KINDS} == {next(p for p, _ in KINDS if re.fullmatch(p, key))
                                                 for key in SAMPLE_KEYS}


@pytest.mark.parametrize("key", sorted(SAMPLE_KEYS))
def test_each_key_takes_its_kind_and_refuses_every_other_in_one_line(tmp_path, key):
    for name, (code, inner, value) in VALUES.items():
        base = {"general.architecture": (8, None, "llama")}
        if key != "tokenizer.ggml.tokens":
            base["tokenizer.ggml.tokens"] = (9, 8, TOKENS)
        path = tmp_path / f"{name}.gguf"
        _gguf(path, {**base, key: (code, inner, value)})
        if name in TAKES[_kind(key)]:
            assert key in read_gguf(path).metadata
            continue
        with pytest.raises(CheckpointError) as caught:
            read_gguf(path)
        line = str(caught.value)
        assert "\n" not in line and line.startswith(f"GGUF file '{path}': metadata '{key}' is "), (name, line)


def test_a_token_type_array_shorter_than_the_vocabulary_is_refused_by_generate(tmp_path, capsys):
    path = tmp_path / "m.gguf"
    _gguf(path, {"general.architecture": (8, None, "llama"), "tokenizer.ggml.tokens": (9, 8, TOKENS),
                 "tokenizer.ggml.token_type": (9, 5, [1, 1])})
    assert main(["generate", str(path), "--prompt", "hi", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "metadata 'tokenizer.ggml.token_type' is an array of 2" in err, err
