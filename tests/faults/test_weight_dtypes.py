"""A model file's integer tensor is never cast into a floating-point weight.

The loader cast every tensor to its parameter's dtype, so a header that said ``I32`` (or ``U32``) where ``F32``
bytes were written, the sizes agreeing, built a model of reinterpreted bytes that generated with exit 0. The
table rewrites the dtype of one weight of each kind (attention, MLP, norm, embedding) to every integer dtype
of the same width: each is one line naming the tensor and both dtypes.
"""

from __future__ import annotations

import json
import shutil
import struct

import pytest

from neutrain.cli import main
from tests.helpers import one_error_line, tiny_hf_folder

WEIGHTS = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
           "model.layers.0.input_layernorm.weight", "model.embed_tokens.weight"]
TABLE = [(w, d) for w in WEIGHTS for d in ("I32", "U32")]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return tiny_hf_folder(tmp_path_factory.mktemp("hf"))


def _with_dtype(folder, out, tensor: str, dtype: str):
    shutil.copytree(folder, out)
    path = out / "model.safetensors"
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    header[tensor]["dtype"] = dtype
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length:])
    return out


@pytest.mark.parametrize("tensor,dtype", TABLE, ids=[f"{t}={d}" for t, d in TABLE])
def test_an_integer_tensor_for_a_floating_weight_is_refused(tiny_folder, tmp_path, capsys, tensor, dtype):
    model = _with_dtype(tiny_folder, tmp_path / "model", tensor, dtype)
    assert main(["generate", str(model), "--prompt", "hi", "--raw", "--max-new-tokens", "2"]) == 2
    captured = capsys.readouterr()
    line = one_error_line(captured.err)
    assert tensor in line and f"holds {'int32' if dtype == 'I32' else 'uint32'} values" in line, line
    assert captured.out == ""
