"""One reader of a compressed checkpoint's weights file: a build from it and a resume into a model read the same
tensors, tied ones included, and no other module parses the file's alias metadata."""

import ast
from pathlib import Path

import torch
from transformers import LlamaConfig

import neutrain
from neutrain.nn.checkpoint import load_compressed_state, save_compressed_checkpoint
from neutrain.nn.checkpoint_reader import WEIGHTS_FILE, read_weights
from neutrain.nn.checkpoint_weights import load_weights
from neutrain.nn.convert import decompressed_state_dict
from neutrain.nn.load import build, init_compressed
from neutrain.nn.model_spec import ModelSpec, Placement
from neutrain.nn.sources import NeutrainCheckpoint

CFG = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=64, tie_word_embeddings=True)
CODEC = {"steps": 16}


def _compressed(seed):
    return init_compressed(CFG, device="cpu", seed=seed, progress=False, codec_options=CODEC)[0]


def test_a_tied_checkpoint_reads_the_same_through_build_and_resume(tmp_path):
    trained = _compressed(0)
    save_compressed_checkpoint(trained, tmp_path, "neuzip-lossless")
    names = dict(read_weights(tmp_path / WEIGHTS_FILE))
    assert "lm_head.weight" in names and isinstance(names["lm_head.weight"], dict)  # the alias, read from one copy
    assert all(torch.equal(names["lm_head.weight"][b], t) for b, t in names["model.embed_tokens.weight"].items())

    built, _ = build(ModelSpec(NeutrainCheckpoint(tmp_path), CFG, torch.bfloat16, codec_options=CODEC,
                               placement=Placement("neuzip-lossless")), progress=False)
    resumed = _compressed(1)
    load_compressed_state(resumed, tmp_path)
    dense = init_compressed(CFG, "dense", device="cpu", seed=1, progress=False)[0]
    assert load_weights(dense, tmp_path)  # across formats: each weight decoded on the way

    expected = decompressed_state_dict(trained, device="cpu")
    for model in (built, resumed):
        assert model.lm_head.weight is model.model.embed_tokens.weight or \
            model.lm_head.compressed is model.model.embed_tokens.compressed
        got = decompressed_state_dict(model, device="cpu")
        assert got.keys() == expected.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    state = dense.state_dict()
    assert dense.lm_head.weight is dense.model.embed_tokens.weight
    assert all(torch.equal(expected[k], state[k]) for k in expected)


def test_no_module_but_the_reader_parses_the_alias_metadata():
    """The alias metadata key, as a string constant, appears in the reader module alone."""
    root = Path(neutrain.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == root / "nn" / "checkpoint_reader.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found += [f"{path.relative_to(root)}:{node.lineno}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and node.value == "aliases"]
    assert not found, f"the checkpoint's alias metadata is parsed outside neutrain/nn/checkpoint_reader.py: {found}"
