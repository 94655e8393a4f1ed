"""`neutrain generate`'s placement: the first form that fits the device budget, from the weights' headers."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from neutrain.cli.placement import GIB, MARGIN_BYTES, _weight_bytes, choose_form
from neutrain.data import byte_tokenizer


@pytest.mark.parametrize(("budget", "form"), [(20, "dense"), (14.5, "neuzip"), (12.7, "neuzip"), (11.5, "neuzip+offload"), (7, "neuzip+offload")])
def test_an_8b_export_takes_the_first_form_that_fits(budget, form):
    # Llama-3-8B: 14.96 GiB of bf16, ~10.2 GiB NeuZip lossless, the embedding (1.96 GiB) the largest matrix.
    dense, compressed, largest = 14.96 * GIB, 10.17 * GIB, 0.98 * GIB
    assert choose_form(dense, compressed, 2 * largest, budget * GIB) == form


def test_the_margin_is_counted():
    assert choose_form(10 * GIB, 7 * GIB, 0, 10 * GIB + MARGIN_BYTES) == "dense"
    assert choose_form(10 * GIB, 7 * GIB, 0, 10 * GIB + MARGIN_BYTES - 1) == "neuzip"


def _export(tmp_path, layers=2):
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=260, max_position_embeddings=128)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    return model


def test_weight_bytes_come_from_the_safetensors_headers(tmp_path):
    model = _export(tmp_path)
    total, largest = _weight_bytes(tmp_path)
    sizes = [p.numel() * p.element_size() for p in model.state_dict().values()]
    # a tied or shared tensor is stored once: count the unique storages the file holds
    assert total == sum({p.data_ptr(): p.numel() * p.element_size() for p in model.state_dict().values()}.values())
    assert largest == max(sizes)


_CHILD = r"""
import json, sys, torch
from pathlib import Path
from neutrain.cli.placement import place_model
from neutrain.eval.engine import DecodeEngine
from neutrain.export import load_checkpoint_model
path, budget = Path(sys.argv[1]), float(sys.argv[2])
ref, _ = load_checkpoint_model(path)
ids = torch.tensor([[3, 17, 99, 5, 42]])
want = DecodeEngine(ref.eval(), max_len=24).generate(ids, 16, temperature=0.0).tolist()
model, tok, note = place_model(path, "auto", budget)
from neutrain.nn.weight_offload_model import weight_store
eng = DecodeEngine(model, max_len=24, cuda_graph=False if weight_store(model) is not None else None)
got = eng.generate(ids.cuda(), 16, temperature=0.0).cpu().tolist()
print(json.dumps({"note": note, "same": got == want, "offloaded": weight_store(model) is not None,
                  "peak": torch.cuda.max_memory_allocated()}))
"""


@pytest.mark.gpu
@pytest.mark.parametrize(("budget", "form"), [(1.0, "dense"), (0.0015, "NeuZip lossless weights on the GPU"),
                                              (0.0009, "streamed from host memory")])
def test_generate_on_cuda_in_each_form_decodes_as_the_dense_model(tmp_path, budget, form):
    """Each form's greedy tokens equal the dense model's; the budget is the allocator's limit (own process)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; run on the device machine")
    _export(tmp_path, layers=4)
    dense, largest = _weight_bytes(tmp_path)
    # budgets in GiB chosen around this tiny model's bytes (dense ~0.3 MiB): scale them to its size
    scaled = {1.0: 1.0, 0.0015: (dense * 0.9 + MARGIN_BYTES) / GIB, 0.0009: (MARGIN_BYTES + 1024) / GIB}[budget]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    res = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), str(scaled)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["same"] and (form in out["note"] if form != "dense" else "dense weights" in out["note"])
    assert out["offloaded"] == (form == "streamed from host memory")


_LOGITS = r"""
import json, sys, torch
from pathlib import Path
from neutrain.cli.placement import build_form
from neutrain.eval.engine import DecodeEngine
from neutrain.export import load_checkpoint_model
from neutrain.nn.weight_offload_model import weight_store
path = Path(sys.argv[1])
ids = torch.tensor([[3, 17, 99, 5, 42, 7, 8, 9]], device="cuda")
def decode(model, graph):
    model.requires_grad_(False)
    engine = DecodeEngine(model, max_len=40, cuda_graph=graph)
    engine.prefill(ids)
    logits = [engine.logits.clone()]
    for _ in range(16):
        engine.step()
        logits.append(engine.logits.clone())
    return engine.fused_groups, torch.stack(logits)
ref, _ = load_checkpoint_model(path)
groups, want = decode(ref.cuda(), None)
out = {"dense_groups": groups}
del ref
torch.cuda.empty_cache()
for form in ("neuzip", "neuzip+offload"):
    model = build_form(path, form, "cuda")
    streamed = weight_store(model) is not None
    groups, got = decode(model, False if streamed else None)
    out[form] = {"groups": groups, "streamed": streamed, "equal": bool(torch.equal(got, want)),
                 "max_difference": float((got - want).abs().max())}
    del model
    torch.cuda.empty_cache()
print(json.dumps(out))
"""


@pytest.mark.gpu
def test_generate_in_every_compressed_form_gives_the_dense_models_logits_bit_for_bit(tmp_path):
    """At Llama-3-8B's widths the GPU's GEMM kernel depends on the matrix shape: the compressed forms must run the
    dense model's fused Q/K/V and gate/up products on the decoded bits, or a greedy decode leaves the dense one
    at a near-tie (an 8B export at a 14.5 GiB budget gave another 16th token than without one)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; run on the device machine")
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=32000, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    del model
    torch.cuda.empty_cache()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    res = subprocess.run([sys.executable, "-c", _LOGITS, str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["dense_groups"] == 4, out
    assert out["neuzip"]["groups"] == 4 and not out["neuzip"]["streamed"] and out["neuzip"]["equal"], out
    assert out["neuzip+offload"]["groups"] == 4 and out["neuzip+offload"]["streamed"], out
    assert out["neuzip+offload"]["equal"], out


def _sharded_export(tmp_path, layers=12):
    """A tiny Llama exported by ``export_hf`` in several shards, with at least one layer split across two of them."""
    from neutrain.export.hf import export_hf

    tok = byte_tokenizer()
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=len(tok), max_position_embeddings=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    path = tmp_path / "export"
    export_hf(model, path, tok, max_shard_size="60KB")
    shards = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    files_of = {}
    for name, file in shards.items():
        if ".layers." in name:
            files_of.setdefault(name.split(".layers.")[1].split(".")[0], set()).add(file)
    # What the regression needs: several shards, and a layer whose tensors sit in two of them.
    assert len(set(shards.values())) >= 3 and max(len(f) for f in files_of.values()) >= 2, files_of
    return model, path, tok


@pytest.mark.slow
def test_generate_streams_a_sharded_export_from_host_memory(tmp_path):
    """``neutrain generate`` under a budget that holds not even the compressed model, from a sharded export.

    The streaming store used to move a layer to host memory whenever the next tensor read belonged to
    another layer; a layer split across shards came back after that, and its first weights were offloaded
    a second time (``ValueError: weight model.layers.8.self_attn.q_proj.weight is already offloaded``).
    Here on the CPU (the store copies synchronously), built as ``place_model`` builds the ``neuzip+offload`` form.
    """
    from neutrain.cli.placement import build_form
    from neutrain.eval.engine import DecodeEngine
    from neutrain.nn import decompressed_state_dict
    from neutrain.nn.weight_offload_model import weight_store

    dense, path, _ = _sharded_export(tmp_path)
    model = build_form(path, "neuzip+offload", device="cpu").eval()
    store = weight_store(model)
    assert store is not None and len(store.layers) == len(dense.model.layers)
    assert all(len(layer.weights) == 7 for layer in store.layers)  # q, k, v, o, gate, up, down: each once
    expected, got = dense.state_dict(), decompressed_state_dict(model)
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []
    ids = torch.tensor([[3, 17, 99, 5, 42]])
    want = DecodeEngine(dense, max_len=24).generate(ids, 12, temperature=0.0).tolist()
    assert DecodeEngine(model, max_len=24, cuda_graph=False, fuse=False).generate(ids, 12, temperature=0.0).tolist() == want


def _compressed_checkpoint(tmp_path, layers=4):
    from neutrain.nn import compress_model
    from neutrain.nn.checkpoint import save_compressed_checkpoint

    model = _export(tmp_path / "dense", layers=layers)
    compress_model(model, progress=False, codec_options={"steps": 16})
    save_compressed_checkpoint(model, tmp_path / "checkpoint-1", "neuzip-lossless")
    byte_tokenizer().save_pretrained(tmp_path / "checkpoint-1")
    return tmp_path / "checkpoint-1"


@pytest.mark.slow
def test_a_compressed_checkpoint_streams_from_host_memory_without_reencoding(tmp_path, monkeypatch):
    """generate's offloaded form of a run's checkpoint places its blobs as they are (the codec never runs)
    and decodes as the checkpoint loaded whole."""
    import neutrain.nn.sink as sink
    from neutrain.cli.placement import build_form
    from neutrain.eval.engine import DecodeEngine
    from neutrain.export import load_checkpoint_model
    from neutrain.nn.weight_offload_model import weight_store

    path = _compressed_checkpoint(tmp_path)
    ref, _ = load_checkpoint_model(path)
    ids = torch.tensor([[3, 17, 99, 5, 42]])
    want = DecodeEngine(ref.eval(), max_len=24).generate(ids, 8, temperature=0.0).tolist()

    def no_encoding(*args, **kwargs):
        raise AssertionError("a checkpoint's compressed weights were encoded again")

    monkeypatch.setattr(sink, "compress", no_encoding, raising=False)
    model = build_form(path, "neuzip+offload", "cpu").eval()
    store = weight_store(model)
    assert store is not None and len(store.layers) == 4
    got = DecodeEngine(model, max_len=24, cuda_graph=False, fuse=False).generate(ids, 8, temperature=0.0).tolist()
    assert got == want


@pytest.mark.gpu
def test_a_compressed_checkpoint_under_a_small_budget_is_streamed_on_cuda(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; run on the device machine")
    path = _compressed_checkpoint(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    res = subprocess.run([sys.executable, "-c", _CHILD, str(path), str((MARGIN_BYTES + 1024) / GIB)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["same"] and out["offloaded"] and "streamed from host memory" in out["note"], out
