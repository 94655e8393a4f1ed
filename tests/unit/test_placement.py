"""`neutrain generate`'s placement: the fastest that fits the device budget, from the config and the weights' headers,
built as decided (the decision's rule: tests/unit/memory/test_residency.py)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from neutrain.cli.placement import GIB, _weight_bytes, resolve
from neutrain.data import byte_tokenizer
from tests.helpers import child_env


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


def test_a_dense_placement_reads_the_folder_once_and_builds_what_the_loader_builds(tmp_path, monkeypatch):
    """The dense branch hands the folder the decision read (its loader and config) to the loader: config.json is
    parsed once and the model is the one ``load_checkpoint_model`` builds on its own."""
    import neutrain.export.hf as hf
    from neutrain.cli.placement import place_on
    from neutrain.export import load_checkpoint_model
    from neutrain.nn.sources import SafetensorsFolder

    _export(tmp_path)
    want, _ = load_checkpoint_model(tmp_path)
    reads, read_config = [], SafetensorsFolder.read_config
    monkeypatch.setattr(SafetensorsFolder, "read_config",
                        lambda self, *a, **k: reads.append(self) or read_config(self, *a, **k))
    monkeypatch.setattr(hf, "folder_format", lambda path: pytest.fail("the loader chose the folder's loader again"))
    model, tokenizer, note, residency = place_on(tmp_path, "cpu", GIB, prompt_tokens=5, new_tokens=16)
    assert residency.form == "dense" and len(reads) == 1
    got, expected = model.state_dict(), want.state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    assert model.dtype == want.dtype


_CHILD = r"""
import json, sys, torch
from pathlib import Path
from neutrain.cli.placement import place_model
from neutrain.decode.engine import DecodeEngine
from neutrain.export import load_checkpoint_model
path, budget = Path(sys.argv[1]), float(sys.argv[2])
ref, _ = load_checkpoint_model(path)
ids = torch.tensor([[3, 17, 99, 5, 42]])
want = DecodeEngine(ref.eval(), max_len=24).generate(ids, 16, temperature=0.0).tolist()
model, tok, note, residency = place_model(path, "auto", budget, prompt_tokens=5, new_tokens=16)
from neutrain.nn.weight_offload_model import weight_store
store = weight_store(model)
eng = DecodeEngine(model, max_len=24, cuda_graph=False if store is not None else None)
got = eng.generate(ids.cuda(), 16, temperature=0.0).cpu().tolist()
print(json.dumps({"note": note, "same": got == want, "offloaded": 0 if store is None else len(store.layers),
                  "streamed": len(residency.streamed), "peak": torch.cuda.max_memory_reserved(),
                  "predicted": residency.predicted.reserved}))
"""


def _least_budget(path, accepts, prompt_tokens: int = 5, new_tokens: int = 16) -> float:
    """The least budget (GiB, a few bytes over) whose decision for ``path`` ``accepts``, by bisection: more budget
    never keeps fewer layers nor gives a slower form (tests/unit/memory/test_residency.py)."""
    from neutrain.errors import UserInputError

    def enough(nbytes: int) -> bool:
        try:
            return accepts(resolve(path, nbytes, prompt_tokens=prompt_tokens, new_tokens=new_tokens))
        except UserInputError:
            return False

    low, high = 0, GIB
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if enough(middle) else (middle, high)
    return (high + 4096) / GIB  # a few bytes over: the budget goes through a float on its way to the child


def _budget_for(path, form: str) -> float:
    """A budget (GiB) under which ``path`` is placed in ``form``: the least whose form is that one or a faster."""
    forms = ("dense", "neuzip", "neuzip+offload")
    return 1.0 if form == "dense" else _least_budget(path, lambda r: forms.index(r.form) <= forms.index(form))


@pytest.mark.slow
def test_the_layers_a_budget_cannot_hold_stream_and_decode_the_resident_models_logits_bit_for_bit(tmp_path):
    """Under a budget that holds 5 of 8 layers, the placement streams the other 3 (spread between resident ones),
    the build puts exactly those in host memory, its line says so, and every step's logits equal those of the
    model with every layer on the device. Here on the CPU (the GPU's flow on another device; the store copies
    synchronously)."""
    from neutrain.cli.placement import build_form, place_on
    from neutrain.decode.engine import DecodeEngine
    from neutrain.nn.weight_offload_model import weight_store

    _export(tmp_path, layers=8)
    ids = torch.tensor([[3, 17, 99, 5, 42]])
    budget = _least_budget(tmp_path, lambda r: r.resident >= 5, new_tokens=12)
    counted = []
    model, tokenizer, note, residency = place_on(
        tmp_path, "cpu", int(budget * GIB), new_tokens=12, prompt_tokens=lambda tok: counted.append(tok) or 5)
    assert counted and counted[0] is tokenizer  # the prompts are counted with the folder's tokenizer, read first
    assert (residency.form, residency.streamed) == ("neuzip+offload", (1, 4, 6))
    assert "keeping 5 of 8 decoder layers on the GPU, streaming 3 from host memory" in note

    def decode(model):
        engine = DecodeEngine(model.eval().requires_grad_(False), max_len=24, cuda_graph=False)
        engine.prefill(ids)
        logits = [engine.logits.clone()]
        for _ in range(11):
            engine.step()
            logits.append(engine.logits.clone())
        return engine.tokens[:, :17].clone(), torch.stack(logits)

    store = weight_store(model)
    assert tuple(int(layer.weights[0].name.split(".")[2]) for layer in store.layers) == residency.streamed
    tokens, logits = decode(model)
    assert store.stats.loads >= 12 * len(residency.streamed)  # every token fetched every streamed layer
    want_tokens, want_logits = decode(build_form(tmp_path, "neuzip", "cpu"))
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["dense", "neuzip", "neuzip+offload"])
def test_generate_on_cuda_in_each_form_decodes_as_the_dense_model(tmp_path, form):
    """Each form's greedy tokens equal the dense model's; the budget is the allocator's limit (own process)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; run on the device machine")
    _export(tmp_path, layers=8)
    budget = _budget_for(tmp_path, form)
    assert resolve(tmp_path, int(budget * GIB), prompt_tokens=5, new_tokens=16).form == form
    env = child_env()
    res = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), str(budget)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    said = {"dense": "dense weights on the GPU", "neuzip": "NeuZip lossless weights on the GPU",
            "neuzip+offload": "from host memory"}[form]
    assert out["same"] and said in out["note"], out
    assert out["offloaded"] == out["streamed"] and (out["streamed"] > 0) == (form == "neuzip+offload"), out
    assert out["peak"] <= budget * GIB, out


_LOGITS = r"""
import json, sys, torch
from pathlib import Path
from neutrain.cli.placement import build_form
from neutrain.decode.engine import DecodeEngine
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
    env = child_env()
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
    from neutrain.decode.engine import DecodeEngine
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
    from neutrain.decode.engine import DecodeEngine
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
    path = _compressed_checkpoint(tmp_path, layers=8)  # with fewer, the store's slots would hold every layer
    env = child_env()
    res = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(_budget_for(path, "neuzip+offload"))],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["same"] and out["offloaded"] and "from host memory" in out["note"], out
