"""A safetensors header is held to the format as its library reads it, by the one reader every safetensors file passes
(a foreign model's, a checkpoint's, a manifest check's): each malformed entry is one line naming the file and the
tensor, never ``int()``'s reading of it (a shape ``[-2, -2]`` matched 16 bytes, ``"4"`` and ``4.9`` were 4), never a
traceback (``Infinity`` in the offsets), never a tensor Python's JSON kept the last of, and a header's claimed length
is bounded before it is read (20 GB were read into memory)."""

from __future__ import annotations

import json
import math
import os
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neutrain.errors import CheckpointError
from neutrain.storage.manifest import check_file, safetensors_header
from neutrain.storage.tensor_layout import DTYPE_BITS, MAX_SAFETENSORS_HEADER

GOOD = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}

# (what is wrong, the header's JSON text, the data bytes)
MALFORMED = [
    ("a tensor named twice", '{"a": %s, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
     % json.dumps(GOOD), 16),
    ("an unknown dtype", json.dumps({"a": {**GOOD, "dtype": "Q9"}}), 16),
    ("a dtype of another type", json.dumps({"a": {**GOOD, "dtype": ["F32"]}}), 16),
    ("negative dims", json.dumps({"a": {**GOOD, "shape": [-2, -2]}}), 16),
    ("a fractional dim", json.dumps({"a": {**GOOD, "shape": [4.9]}}), 16),
    ("a dim as text", json.dumps({"a": {**GOOD, "shape": ["4"]}}), 16),
    ("a dim as a boolean", json.dumps({"a": {**GOOD, "shape": [True, 4]}}), 16),
    ("a dim past 64 bits", json.dumps({"a": {**GOOD, "shape": [2 ** 70, 0], "data_offsets": [0, 0]},
                                       "b": {**GOOD, "shape": [4]}}), 16),
    ("a shape that is no list", json.dumps({"a": {**GOOD, "shape": "16"}}), 16),
    ("offsets as text", json.dumps({"a": {**GOOD, "data_offsets": ["0", "16"]}}), 16),
    ("fractional offsets", json.dumps({"a": {**GOOD, "data_offsets": [0.0, 16.0]}}), 16),
    ("infinite offsets", '{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, Infinity]}}', 16),
    ("three offsets", json.dumps({"a": {**GOOD, "data_offsets": [0, 16, 99]}}), 16),
    ("reversed offsets", json.dumps({"a": {**GOOD, "shape": [0], "data_offsets": [16, 0]}}), 16),
    ("shape and offsets apart", json.dumps({"a": {**GOOD, "shape": [3]}}), 16),
    ("offsets past the data", json.dumps({"a": {**GOOD, "shape": [8], "data_offsets": [0, 32]}}), 16),
    ("overlapping tensors", json.dumps({"a": GOOD, "b": {**GOOD, "shape": [2], "data_offsets": [8, 16]}}), 16),
    ("bytes after the tensors", json.dumps({"a": GOOD}), 20),
    ("an entry that is no mapping", json.dumps({"a": "x", "b": GOOD}), 16),
    ("an entry without its dtype", json.dumps({"a": {"shape": [4], "data_offsets": [0, 16]}}), 16),
    ("__metadata__ a list", json.dumps({"__metadata__": [1], "a": GOOD}), 16),
    ("__metadata__ values not text", json.dumps({"__metadata__": {"format": 5}, "a": GOOD}), 16),
    ("a header that is a list", json.dumps([GOOD]), 16),
    ("a header that is not JSON", '{"a": ', 16),
    ("a header that is not UTF-8", b'{"\xff": 1}', 16),
    ("a lone surrogate", '{"a\\ud800": %s}' % json.dumps(GOOD), 16),
]


def _file(tmp_path, header, data_bytes: int, name: str = "model.safetensors"):
    head = header if isinstance(header, bytes) else header.encode()
    path = tmp_path / name
    path.write_bytes(struct.pack("<Q", len(head)) + head + bytes(data_bytes))
    return path


def _refused(call, path) -> str:
    with pytest.raises(CheckpointError) as caught:
        call()
    line = str(caught.value)
    assert "\n" not in line and line.startswith(f"checkpoint file '{path}'"), line
    return line


@pytest.mark.parametrize("wrong,header,data_bytes", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_every_malformed_header_is_one_line_naming_the_file_in_every_reader(tmp_path, wrong, header, data_bytes):
    path = _file(tmp_path, header, data_bytes)
    _refused(lambda: safetensors_header(path), path)
    _refused(lambda: check_file(path), path)  # a checkpoint's or export's file, before its manifest is trusted


def test_a_header_longer_than_the_formats_bound_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as fh:  # sparse: no disk is used, whatever the machine
        fh.write(struct.pack("<Q", 2 * MAX_SAFETENSORS_HEADER))
        fh.truncate(8 + 2 * MAX_SAFETENSORS_HEADER)
    line = _refused(lambda: safetensors_header(path), path)
    assert "bound" in line


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(dtype=st.sampled_from(sorted(DTYPE_BITS)), shape=st.lists(st.integers(0, 6), max_size=3),
       skew=st.sampled_from([0, 0, 1, -1]))
def test_a_header_of_known_dtype_is_taken_exactly_when_its_bytes_are_its_shapes(tmp_path_factory, dtype, shape, skew):
    # The oracle is the format's rule: ceil(elements * bits / 8) bytes; one byte more or less is refused.
    size = (DTYPE_BITS[dtype] * math.prod(shape) + 7) // 8
    stop = size + skew
    if stop < 0:
        return
    path = _file(tmp_path_factory.mktemp("st"), json.dumps({"w": {"dtype": dtype, "shape": shape,
                                                                  "data_offsets": [0, stop]}}), stop)
    if skew:
        _refused(lambda: safetensors_header(path), path)
    else:
        start, header = safetensors_header(path)
        assert start == os.path.getsize(path) - stop and header["w"]["shape"] == shape
