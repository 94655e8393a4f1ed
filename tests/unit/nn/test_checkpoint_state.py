"""Loading a checkpoint's compressed weights into a built model: every old blob goes before the first new one comes.

On a GPU, new blobs allocated among the still-live blobs of other weights left holes the allocator could not
hand back, and a resumed run ran out of memory under a budget the uninterrupted run met. The order is what
this checks (the CUDA allocator's holes themselves need a GPU: tests/unit/nn/test_phase_memory_gpu.py)."""

import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from neutrain.compress import CompressedTensor
from neutrain.errors import CheckpointError
from neutrain.nn import compress_model, compressed_weights
from neutrain.nn.checkpoint import load_compressed_state, save_compressed_checkpoint
from neutrain.nn.convert import decompressed_state_dict

CFG = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=64, tie_word_embeddings=False)


def _model(seed):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CFG, dtype=torch.bfloat16)
    compress_model(model, progress=False, codec_options={"steps": 16})
    return model


def test_every_old_blob_is_released_before_the_first_new_one_is_placed(tmp_path, monkeypatch):
    save_compressed_checkpoint(_model(0), tmp_path, "neuzip-lossless")
    other = _model(1)
    old = {w.name: weakref.ref(w.ct) for w in compressed_weights(other)}
    placed = []
    to = CompressedTensor.to

    def checked_to(self, device):
        alive = [name for name, ref in old.items() if ref() is not None]
        assert not alive, f"{self.name} was placed while the old blobs of {alive} were alive"
        placed.append(self.name)
        return to(self, device)

    monkeypatch.setattr(CompressedTensor, "to", checked_to)
    load_compressed_state(other, tmp_path)
    assert sorted(placed) == sorted(old)
    expected = decompressed_state_dict(_model(0), device="cpu")
    got = decompressed_state_dict(other, device="cpu")
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_a_weight_of_another_shape_is_refused_and_named(tmp_path):
    save_compressed_checkpoint(_model(0), tmp_path, "neuzip-lossless")
    wider = AutoModelForCausalLM.from_config(CFG.__class__(**{**CFG.to_dict(), "intermediate_size": 96}),
                                             dtype=torch.bfloat16)
    compress_model(wider, progress=False, codec_options={"steps": 16})
    with pytest.raises(CheckpointError, match=r"mlp\.(gate|up|down)_proj\.weight: loaded"):
        load_compressed_state(wider, tmp_path)
