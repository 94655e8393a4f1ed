"""A model file's structure is checked before a reader trusts it: every tensor's bytes inside the data section,
none shared with another tensor, its byte count what its type and shape say.

A GGUF file whose ``blk.1.ffn_up`` data offset equalled ``blk.1.ffn_gate``'s generated with exit 0 and no
message: two weights read the same bytes. The table corrupts a GGUF file's and a safetensors file's header
in each way, and every command that loads the file must refuse it in one line naming the file and the
tensor; a generated test holds the range check to a brute-force one.
"""

from __future__ import annotations

import json
import shutil
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neutrain.cli import main
from neutrain.storage.gguf_header import check_gguf_file
from tests.helpers import one_error_line, write_recipe

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    from tests.gguf_writer import tiny_llama, tiny_tokenizer, write_gguf

    tokenizer = tiny_tokenizer()
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tiny_llama(len(tokenizer)), tokenizer)


def _field(data: bytes, name: str) -> tuple[int, int]:
    """(position of the tensor's dimension count, of its type) in a GGUF header, found by the tensor's name."""
    at = data.index(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name)
    dims = struct.unpack_from("<I", data, at)[0]
    return at, at + 4 + 8 * dims


def _corrupt(data: bytes, how: str) -> bytes:
    data = bytearray(data)
    up_dims, up_type = _field(data, "blk.1.ffn_up.weight")
    _, gate_type = _field(data, "blk.1.ffn_gate.weight")
    up_offset, gate_offset = up_type + 4, gate_type + 4
    gate = struct.unpack_from("<Q", data, gate_offset)[0]
    if how == "shared":  # two tensors, one range: it loaded and generated without a word
        struct.pack_into("<Q", data, up_offset, gate)
    elif how == "overlapping":
        struct.pack_into("<Q", data, up_offset, gate + 64)
    elif how == "past the end":
        struct.pack_into("<Q", data, up_offset, 1 << 30)
    elif how == "misaligned":
        struct.pack_into("<Q", data, up_offset, gate + 1)
    elif how == "unknown type":
        struct.pack_into("<I", data, up_type, 99)
    elif how == "not whole blocks":
        struct.pack_into("<I", data, up_type, 12)  # Q4_K: 256-element blocks, rows of 64
    elif how == "shape larger than its bytes":
        struct.pack_into("<Q", data, up_dims + 4 + 8, 10_000)
    return bytes(data)


GGUF_CASES = {
    "shared": "tensors 'blk.1.ffn_up.weight' and 'blk.1.ffn_gate.weight' share bytes",
    "overlapping": "tensors 'blk.1.ffn_up.weight' and 'blk.1.ffn_gate.weight' share bytes",
    "past the end": "tensor 'blk.1.ffn_up.weight' ends at data byte",
    "misaligned": "tensor 'blk.1.ffn_up.weight' starts at data byte",
    "unknown type": "tensor 'blk.1.ffn_up.weight' has the unknown tensor type 99",
    "not whole blocks": "tensor 'blk.1.ffn_up.weight' has rows of 64 elements, not a whole number of its type's 256",
    "shape larger than its bytes": "blk.1.ffn_up.weight",
}


@pytest.mark.parametrize("how", sorted(GGUF_CASES))
def test_a_gguf_header_whose_tensors_lie_is_refused_naming_the_file_and_tensor(gguf_model, tmp_path, how):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(_corrupt(gguf_model.read_bytes(), how))
    with pytest.raises(Exception) as info:
        check_gguf_file(bad)
    assert str(info.value).startswith(f"GGUF file '{bad}': ") and GGUF_CASES[how] in str(info.value), str(info.value)


def test_the_intact_file_passes(gguf_model):
    check_gguf_file(gguf_model)


@pytest.mark.parametrize("command", ["generate", "train"])
def test_every_command_that_loads_a_gguf_refuses_two_tensors_on_the_same_bytes(gguf_model, tmp_path, capsys, command):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(_corrupt(gguf_model.read_bytes(), "shared"))
    if command == "generate":
        argv = ["generate", str(bad), "--prompt", "hi", "--raw", "--max-new-tokens", "2"]
    else:
        recipe = write_recipe(tmp_path, model={"init": "pretrained", "gguf_file": str(bad), "config": None,
                                               "tokenizer": None})
        argv = ["train", str(recipe)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    line = one_error_line(captured.err)
    assert f"GGUF file '{bad}': tensors 'blk.1.ffn_up.weight' and 'blk.1.ffn_gate.weight' share bytes" in line, line
    assert captured.out == ""


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from neutrain.data import byte_tokenizer

    folder = tmp_path_factory.mktemp("hf")
    tokenizer = byte_tokenizer()
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=len(tokenizer))).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _rewrite_header(path, change) -> None:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    change(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (length - len(text)) if len(text) <= length else b""
    assert len(text) == length, "the new header must keep the old one's length"
    path.write_bytes(data[:8] + text + data[8 + length:])


SAFETENSORS_CASES = {
    "shared": (lambda h: h["model.layers.1.mlp.up_proj.weight"].update(
        data_offsets=h["model.layers.1.mlp.gate_proj.weight"]["data_offsets"]),
        "tensors 'model.layers.1.mlp.up_proj.weight' and 'model.layers.1.mlp.gate_proj.weight' share bytes"),
    "shape against bytes": (lambda h: h["model.norm.weight"].update(shape=[33]),
                            "tensor 'model.norm.weight' has inconsistent offsets"),
    "past the data": (lambda h: h["model.norm.weight"].update(data_offsets=[900000, 900128]),
                      "tensor 'model.norm.weight' ends at byte 900128 of 140672 data bytes"),
}


@pytest.mark.parametrize("how", sorted(SAFETENSORS_CASES))
@pytest.mark.parametrize("command", ["generate", "export"])
def test_a_safetensors_header_whose_tensors_lie_is_refused_by_every_command(hf_model, tmp_path, capsys, how, command):
    model = tmp_path / "model"
    shutil.copytree(hf_model, model)
    change, said = SAFETENSORS_CASES[how]
    _rewrite_header(model / "model.safetensors", change)
    if command == "generate":
        argv = ["generate", str(model), "--prompt", "hi", "--raw", "--max-new-tokens", "2"]
    else:
        argv = ["export", str(model), "--output", str(tmp_path / "out")]
    assert main(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"'{model / 'model.safetensors'}'" in line and said in line, line


RANGES = st.lists(st.tuples(st.integers(0, 64), st.integers(0, 16)), max_size=6)


@settings(max_examples=500, deadline=None)
@given(RANGES, st.integers(0, 80))
def test_the_range_check_refuses_exactly_what_overlaps_or_leaves_the_data(spans, size):
    from neutrain.storage.tensor_layout import check_ranges

    ranges = [(f"t{i}", begin, begin + length) for i, (begin, length) in enumerate(spans)]
    used = [set(range(b, e)) for _, b, e in ranges]
    bad = any(e > size for _, _, e in ranges) or any(used[i] & used[j] for i in range(len(used))
                                                    for j in range(i + 1, len(used)))
    try:
        check_ranges("f", ranges, size, ValueError)
    except ValueError:
        assert bad
    else:
        assert not bad


def test_empty_tensors_share_no_bytes():
    from neutrain.storage.tensor_layout import check_ranges

    check_ranges("f", [("a", 8, 8), ("b", 8, 8), ("c", 0, 16)], 16, ValueError)  # a zero-element tensor: no bytes
