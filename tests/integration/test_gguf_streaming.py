"""The GGUF path builds a model tensor by tensor, dense or compressed.

1. The weights are bit-identical to transformers' whole-file load (Q/K un-permuted, Q8_0 blocks
   decoded in row chunks that split matrices unevenly).
2. Peak host memory stays under 1.5x (compressed model + one dense tensor): measured in a subprocess
   on a ~100 MB GGUF, as the rise of VmHWM over the resident set after imports (``/proc/self/clear_refs``
   resets the high-water mark). The whole-file path (dequantize, then compress) peaked at ~2.6x there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from tests.gguf_writer import tiny_llama, tiny_tokenizer, write_gguf  # noqa: E402
from tests.helpers import child_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_streamed_gguf_weights_equal_the_whole_file_load(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from neutrain.compat import gguf_dequantized_kwargs, gguf_tensors
    from neutrain.nn import decompressed_state_dict
    from neutrain.nn.gguf import load_gguf_compressed, load_gguf_model

    tok = tiny_tokenizer()
    path = write_gguf(tmp_path / "tiny-q8_0.gguf", tiny_llama(len(tok)), tok, "Q8_0")
    monkeypatch.setattr(gguf_tensors, "ROWS_PER_CHUNK", 7)  # 64 and 128 rows: uneven chunks
    # transformers' own whole-file load is the reference for both of neutrain's streamed builds.
    whole = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.bfloat16,
                                                 **gguf_dequantized_kwargs())
    dense = load_gguf_model(str(tmp_path), path.name, torch.bfloat16, "sdpa")
    compressed, report = load_gguf_compressed(str(tmp_path), path.name, "neuzip-lossless", torch.bfloat16,
                                              attn_implementation="sdpa", progress=False)
    assert report.converted > 0
    expected = whole.state_dict()
    for got in (dense.state_dict(), decompressed_state_dict(compressed)):
        assert got.keys() == expected.keys()
        assert [k for k in expected if not torch.equal(got[k], expected[k])] == []
    assert compressed.config._attn_implementation == "sdpa" and dense.config._attn_implementation == "sdpa"


_MEASURE = r"""
import json, os, sys
import torch
from neutrain.compress import compress
from neutrain.nn import gguf
from neutrain.nn.convert import compress_model, model_nbytes
from neutrain.nn.load import _skeleton

source, name, path = sys.argv[1], sys.argv[2], sys.argv[3]

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

# Imports, the codec's compiled kernels and the model class's module are in the baseline.
compress(torch.randn(256, 256).bfloat16())
_skeleton(gguf.gguf_config(source, name), torch.bfloat16)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
baseline = status("VmRSS")
if os.environ.get("WHOLE_FILE"):  # the path before streaming: transformers' dense load, then compressed
    from transformers import AutoModelForCausalLM
    from neutrain.compat import gguf_dequantized_kwargs
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.bfloat16, **gguf_dequantized_kwargs())
    compress_model(model, "neuzip-lossless", progress=False)
else:
    model, _ = gguf.load_gguf_compressed(source, name, "neuzip-lossless", torch.bfloat16, progress=False)
peak = status("VmHWM") - baseline
from gguf import GGUFReader
largest = max(t.n_elements for t in GGUFReader(path).tensors) * 4  # dequantized to fp32
json.dump({"peak": peak, "model": model_nbytes(model), "largest_fp32": largest}, open(sys.argv[4], "w"))
"""


def _measure(tmp_path, path, whole_file=False):
    out = tmp_path / ("whole.json" if whole_file else "streamed.json")
    env = child_env(HF_HUB_OFFLINE="1")
    if whole_file:
        env["WHOLE_FILE"] = "1"
    subprocess.run([sys.executable, "-c", _MEASURE, str(path.parent), path.name, str(path), str(out)],
                   check=True, env=env, cwd=ROOT, timeout=600)
    return json.loads(out.read_text())


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's /proc/self/clear_refs")
def test_gguf_load_peak_memory_is_the_compressed_model_plus_one_tensor(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_tokenizer()
    # ~26M parameters, F32: a 105 MB file of 10 layers, no tensor above 4 MB in fp32.
    config = LlamaConfig(vocab_size=len(tok), hidden_size=512, intermediate_size=1024, num_hidden_layers=10,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
                         tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    path = write_gguf(tmp_path / "medium-f32.gguf", model, tok, "F32")
    del model
    assert path.stat().st_size > 100e6
    got = _measure(tmp_path, path)
    bound = 1.5 * (got["model"] + got["largest_fp32"])
    assert got["peak"] < bound, (f"GGUF load peaked {got['peak'] / 2**20:.0f} MiB above the baseline; the compressed "
                                 f"model is {got['model'] / 2**20:.0f} MiB, the largest tensor "
                                 f"{got['largest_fp32'] / 2**20:.1f} MiB in fp32 (bound {bound / 2**20:.0f} MiB)")
