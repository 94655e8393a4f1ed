"""The zgemv serving mode (``attach_zgemv(release=True)``, ``DecodeEngine(zgemv="replace")``): the layouts replace
the NeuZip payloads, which are freed; prefill decodes from the layouts; saving gives the bytes saved before
attaching; detaching restores every payload bit for bit."""

import copy
import gc
import weakref

import pytest
import torch

pytest.importorskip("triton")

from neutrain.decode.engine import DecodeEngine  # noqa: E402
from neutrain.decode.zgemv import attach_zgemv, detach_zgemv, zgemv_payload_bytes  # noqa: E402
from neutrain.nn import CompressedLinear  # noqa: E402
from tests.unit.decode.test_fused_projections import _decode_logits, tiny  # noqa: E402

SEED = 11  # inputs of their own: none of the other zgemv tests draw these


def _compressed(seed=SEED, layers=1, drift=True):
    """A tiny compressed Llama; with ``drift`` one matrix re-encoded with new values under its old code (as an
    optimizer's write leaves it), so its payload is not what a fresh ``compress`` of its values writes."""
    from neutrain.nn.convert import compress_model

    model = tiny(seed, dtype=torch.bfloat16, layers=layers)
    compress_model(model, progress=False)
    model.requires_grad_(False)
    if drift:
        weight = model.model.layers[0].mlp.down_proj.compressed
        new = weight.dense().clone()
        new.view(-1)[::500] *= 2  # a small drift: the old code stays (no rebuild), its counters move
        weight.ct.recompress_(new)
        assert weight.ct.rebuilds == 0
        weight.version += 1
    return model


def _linear_weights(model):
    return list({id(m.compressed): m.compressed for m in model.modules() if isinstance(m, CompressedLinear)}.values())


def _blobs(weight):
    return {k: v.clone() for k, v in weight.ct.state_dict().items()}


@pytest.mark.slow
def test_replace_mode_engine_equals_the_zgemv_mode_prefill_and_steps(monkeypatch):
    from neutrain.compress.zgemv import ZgemvWeight

    beside = _compressed()
    served = copy.deepcopy(beside)
    prompt = torch.randint(1, 64, (1, 10), generator=torch.Generator().manual_seed(SEED))  # 10 rows: a prefill
    decoded = []
    real = ZgemvWeight.decode_into
    monkeypatch.setattr(ZgemvWeight, "decode_into",
                        lambda zw, out, *a, **k: decoded.append(tuple(out.shape)) or real(zw, out, *a, **k))
    want_tokens, want = _decode_logits(DecodeEngine(beside, max_len=24, zgemv=True), prompt, 3)
    assert not decoded  # the zgemv mode's prefill read the payloads
    engine = DecodeEngine(served, max_len=24, zgemv="replace")
    assert engine.zgemv_matrices == len(served._neutrain_zgemv) >= 4
    assert zgemv_payload_bytes(served)["released"] == len(_linear_weights(served))
    tokens, got = _decode_logits(engine, prompt, 3)
    assert tokens == want_tokens
    assert torch.equal(got, want)  # the same bf16 bits in the same products
    # the prefill decoded each member of QKV and gate/up and o, down from the layouts (the lm_head takes one row)
    assert len(decoded) == 7 and (64, 96) in decoded


def test_release_frees_the_payloads_and_detach_restores_them_bit_for_bit():
    model = _compressed()
    weights = _linear_weights(model)
    before = {id(w): _blobs(w) for w in weights}
    dense = {id(w): w.dense().view(torch.int16).clone() for w in weights}
    streams = [weakref.ref(w.ct.stream) for w in weights]
    payload = zgemv_payload_bytes(model)["payload"]
    tables = sum(w.ct.enc_table.nbytes + w.ct.lut.nbytes + w.ct.code_lengths.size for w in weights)
    assert attach_zgemv(model, release=True) == len(weights) == 8  # unfused: q, k, v, o, gate, up, down, lm_head
    gc.collect()
    assert all(ref() is None for ref in streams)  # the streams are freed, not just hidden
    held = zgemv_payload_bytes(model)
    # all that is left of the payloads is their code tables (a few KiB each, whatever the matrix's size)
    assert held["released"] == len(weights) and held["payload"] == tables < payload - 40_000, (held, payload)
    numel = sum(w.numel for w in weights)
    assert 12 <= 8 * held["zgemv"] / numel < 14  # what the model holds for them: the layouts' ~12 bits a weight
    down = model.model.layers[0].mlp.down_proj.compressed
    with pytest.raises(AttributeError, match="payload is released"):
        down._ct.stream  # noqa: B018 -- never an empty or freed buffer read as data
    for w in weights:  # decodes read the layouts: the same bits
        assert torch.equal(w.dense().view(torch.int16), dense[id(w)])
    assert detach_zgemv(model) == 8
    for w in weights:
        assert not w.released
        got = w.ct.state_dict()
        assert got.keys() == before[id(w)].keys()
        assert all(torch.equal(got[k], before[id(w)][k]) for k in got), w.name
        assert torch.equal(w.ct.decompress().view(torch.int16), dense[id(w)])
    assert zgemv_payload_bytes(model)["payload"] == payload


def test_saving_while_released_gives_the_bytes_saved_before_attaching(tmp_path):
    from neutrain.nn.checkpoint import save_compressed_checkpoint

    model = _compressed(seed=SEED + 1)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    save_compressed_checkpoint(model, tmp_path / "before", "neuzip")
    attach_zgemv(model, release=True)
    got = model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    del got
    save_compressed_checkpoint(model, tmp_path / "after", "neuzip")
    for path in (tmp_path / "before").iterdir():
        assert path.read_bytes() == (tmp_path / "after" / path.name).read_bytes(), path.name
    assert zgemv_payload_bytes(model)["released"] == len(_linear_weights(model))  # saving left them released


def test_reading_the_payload_restores_it_and_a_wrong_layout_is_refused():
    model = _compressed(seed=SEED + 2, drift=False)
    attach_zgemv(model, release=True)
    o_proj = model.model.layers[0].self_attn.o_proj.compressed
    blobs = o_proj._ct.restore().state_dict()
    assert o_proj.ct is o_proj._ct and not o_proj.released  # an optimizer's write or export gets it, for good
    assert all(torch.equal(o_proj.ct.state_dict()[k], v) for k, v in blobs.items())
    down = model.model.layers[0].mlp.down_proj
    new = (torch.randn(down.compressed.shape) * 0.02).bfloat16()
    down.compressed.write_(new)  # an optimizer's write on a released weight: restored, then re-encoded
    assert not down.compressed.released and down._neutrain_zgemv.versions != [down.compressed.version]
    with torch.no_grad():  # the compressed path serves the new values (the layout is stale now)
        x = torch.randn(3, 96).bfloat16()
        assert torch.equal(down(x), torch.nn.functional.linear(x, new))
    up = model.model.layers[0].mlp.up_proj
    up._neutrain_zgemv.zw.raw[0, 0, 0] ^= 1 << 9  # one bit of one low byte
    with pytest.raises(RuntimeError, match="differs from the released one"):
        detach_zgemv(model)
    assert up.compressed.released  # the layout still serves it: nothing is lost


@pytest.mark.slow
def test_engine_decode_benchmark_measures_the_replace_row_and_gives_the_payloads_back():
    """benchmarks/decode/engine_decode.py's zgemv rows on the CPU (Triton's interpreter), so the GPU script cannot rot:
    the replace row decodes the beside row's tokens, records what the payloads hold, and restores them after."""
    from benchmarks.decode.engine_decode import measure_variant

    model = _compressed(seed=SEED + 3, drift=False)
    weights = _linear_weights(model)
    before = {id(w): _blobs(w) for w in weights}
    prompt = torch.randint(1, 64, (1, 9), generator=torch.Generator().manual_seed(SEED + 3))
    rows, outputs = measure_variant(model, prompt, 3, 1, ["engine_graph_zgemv", "engine_graph_zgemv_replace"],
                                    torch.device("cpu"))
    beside, served = rows
    assert "error" not in beside and "error" not in served and "detach_error" not in served, rows
    assert torch.equal(outputs["engine_graph_zgemv"], outputs["engine_graph_zgemv_replace"])
    assert beside["zgemv_payload_bytes"]["released"] == 0 and served["zgemv_payload_bytes"]["released"] == len(weights)
    assert served["zgemv_payload_bytes"]["payload"] < beside["zgemv_payload_bytes"]["payload"]
    assert served["tokens_per_s"] > 0 and served["zgemv_bits_per_weight"] > 12
    for w in weights:  # the row's detach gave every payload back, exact
        assert not w.released and all(torch.equal(w.ct.state_dict()[k], v) for k, v in before[id(w)].items())


@pytest.mark.gpu
def test_replace_mode_on_the_gpu_graphs_memory_and_exact_restore():
    """On CUDA: the device memory drops by the payloads' bytes; the engine's graphed steps in replace mode decode the
    zgemv mode's tokens and logits; the Triton encoder restores every payload in the bytes it had (twice here)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from neutrain.nn.convert import compress_model

    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, eos_token_id=None,
                         bos_token_id=None, pad_token_id=0)
    beside = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    compress_model(beside, progress=False)
    beside.requires_grad_(False)
    served = copy.deepcopy(beside)
    weights = _linear_weights(served)
    before = {id(w): _blobs(w) for w in weights}
    prompt = torch.randint(1, 512, (1, 12), generator=torch.Generator().manual_seed(SEED)).cuda()
    want_tokens, want = _decode_logits(DecodeEngine(beside, max_len=40, zgemv=True), prompt, 6)
    del beside
    allocated = []
    for release in (False, True):  # the same layouts; in replace mode without the payloads
        attach_zgemv(served, release=release)
        gc.collect()
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
        held = zgemv_payload_bytes(served)
        detach_zgemv(served)
    payload = zgemv_payload_bytes(served)["payload"]
    assert allocated[0] - allocated[1] >= 0.9 * (payload - held["payload"]) > 0, (allocated, payload, held)
    engine = DecodeEngine(served, max_len=40, zgemv="replace")
    assert engine.use_graph and zgemv_payload_bytes(served)["released"] == len(weights)
    tokens, got = _decode_logits(engine, prompt, 6)
    assert tokens == want_tokens and torch.equal(got, want)
    del engine
    detach_zgemv(served)
    for w in weights:
        got = w.ct.state_dict()
        assert all(torch.equal(got[k], v) for k, v in before[id(w)].items()), w.name
