"""Model formats: one object per format, chosen once, answers everything downstream asks; a new format is one
class and one registration, and builds through the one build path."""

import ast
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import neutrain
from neutrain.nn.checkpoint import save_compressed_checkpoint
from neutrain.nn.formats import (CheckpointWeights, GGUFWeights, ModelFormat, ModelRef, NeuZipExportWeights,
                                 RandomWeights, SafetensorsWeights, folder_format, load_compressed, register_format,
                                 resolve_format, unregister_format)
from neutrain.nn.load import init_compressed
from neutrain.nn.model_spec import ModelSpec, Placement
from neutrain.nn.sources import RandomInit

CFG = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=64, tie_word_embeddings=False)
CODEC = {"steps": 16}


class NpzArrays:
    """A tensor source over a ``.npz`` of the model's parameter names, its config under ``config``."""

    def __init__(self, path):
        self.path = Path(path)

    def read_config(self, trust_remote_code=False):
        with np.load(self.path) as arrays:
            return LlamaConfig(**json.loads(str(arrays["config"])))

    def keys(self):
        with np.load(self.path) as arrays:
            return [k for k in arrays.files if k != "config"]

    def tensors(self, model, device, dtype):
        with np.load(self.path) as arrays:
            for name in self.keys():
                yield name, torch.from_numpy(arrays[name]).to(device=device, dtype=dtype)

    def generation_config(self):
        return None

    def stored_dtype(self):
        return torch.float32


class NpzWeights(ModelFormat):
    name = "npz arrays"

    @classmethod
    def matches(cls, ref):
        return ref.path is not None and str(ref.path).endswith(".npz")

    def source(self):
        return NpzArrays(self.ref.path)


def _save_npz(model, path):
    arrays = {k: v.float().numpy() for k, v in model.state_dict().items()}
    np.savez(path, config=json.dumps(model.config.to_diff_dict()), **arrays)


def test_a_registered_format_builds_through_the_build_path_and_goes_when_unregistered(tmp_path):
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(CFG, dtype=torch.float32)
    path = tmp_path / "tiny.npz"
    _save_npz(reference, path)
    register_format(NpzWeights)
    try:
        fmt = folder_format(path)
        assert isinstance(fmt, NpzWeights) and fmt.stored_dtype() == torch.float32 and not fmt.encoded
        dense, _ = fmt.build(ModelSpec(fmt.source(), fmt.read_config(), torch.float32), progress=False)
        got, want = dense.state_dict(), reference.state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        compressed, report = load_compressed(path, device="cpu", dtype=torch.float32, progress=False,
                                             codec_options=CODEC)
        assert type(compressed.model.layers[0].mlp.up_proj).__name__ == "CompressedLinear"
        ids = torch.tensor([[1, 5, 9, 33]])
        with torch.no_grad():
            assert torch.equal(compressed(ids).logits, reference(ids).logits)  # lossless
    finally:
        unregister_format(NpzWeights)
    assert type(folder_format(path)) is SafetensorsWeights  # the catch-all again


def test_each_reference_resolves_to_the_format_that_answers_for_it(tmp_path):
    assert type(resolve_format(ModelRef(random=True, gguf_file="m.gguf"))) is RandomWeights
    gguf = resolve_format(ModelRef("org/repo", "m.gguf"))
    assert type(gguf) is GGUFWeights and (gguf.source().source, gguf.source().name) == ("org/repo", "m.gguf")
    assert type(resolve_format(ModelRef("org/repo"))) is SafetensorsWeights
    model, _ = init_compressed(CFG, device="cpu", progress=False, codec_options=CODEC)
    save_compressed_checkpoint(model, tmp_path / "ckpt", "neuzip-lossless")
    ckpt = folder_format(tmp_path / "ckpt")
    assert type(ckpt) is CheckpointWeights and ckpt.resumable and ckpt.encoded
    assert ckpt.source().weights == "neuzip-lossless"
    (tmp_path / "nz").mkdir()
    (tmp_path / "nz" / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "neuzip"}}))
    nz = folder_format(tmp_path / "nz")
    assert type(nz) is NeuZipExportWeights and nz.encoded and not nz.resumable


def test_random_weights_are_a_format_like_the_others():
    fmt = resolve_format(ModelRef(random=True, seed=7, recipe_config=lambda: CFG))
    assert fmt.source() == RandomInit(7) and fmt.read_config() is CFG and fmt.stored_dtype() is None
    model, _ = fmt.build(ModelSpec(fmt.source(), fmt.read_config(), torch.bfloat16, codec_options=CODEC,
                                   placement=Placement("neuzip-lossless")), progress=False)
    again, _ = init_compressed(CFG, device="cpu", seed=7, progress=False, codec_options=CODEC)
    ids = torch.tensor([[1, 5, 9, 33]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)


@pytest.mark.parametrize("consumer", ["trainer/modeling.py", "export/hf.py", "cli/placement.py"])
def test_no_consumer_asks_which_format_a_model_is(consumer):
    """The format object answers; a consumer that tests a source's class chose the format a second time."""
    sources = {"RandomInit", "SafetensorsFolder", "NeutrainCheckpoint", "NeuZipExport", "GGUFFile"}
    tree = ast.parse((Path(neutrain.__file__).parent / consumer).read_text(encoding="utf-8"))
    asked = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Name) and node.id in sources]
    assert not asked, f"neutrain/{consumer} names a tensor source class (lines {asked}): ask its ModelFormat instead"
