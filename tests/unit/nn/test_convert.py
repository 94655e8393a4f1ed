"""compress_model / load_compressed / init_compressed: no dense copy survives, state round-trips."""

import copy
import gc
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file

from neutrain.nn import CompressedLinear, compress_model, compressed_weights, decompressed_state_dict, model_nbytes
from neutrain.nn.formats import load_compressed
from neutrain.nn.load import init_compressed
from neutrain.optim import AdaLomo

from .nn_helpers import CODEC, dense_and_compressed, tiny_llama, token_batches, train, weights


def _live_tensor_bytes():
    from torch._subclasses.fake_tensor import is_fake

    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        # Fake tensors (what torch.compile traced with, kept by its caches) hold no memory and have no data pointer.
        if issubclass(type(obj), torch.Tensor) and not obj.is_meta and obj.device.type == "cpu" and not is_fake(obj):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@pytest.mark.slow
def test_no_dense_copy_survives_conversion():
    baseline = _live_tensor_bytes()
    model = tiny_llama(layers=1, hidden=256)
    dense_refs = [weakref.ref(p) for n, p in model.named_parameters() if p.dim() == 2]
    dense_total = model_nbytes(model)
    report = compress_model(model, progress=False, codec_options=CODEC)
    gc.collect()
    assert all(ref() is None for ref in dense_refs), "a dense weight is still referenced"
    live = _live_tensor_bytes() - baseline
    compressed_total = sum(w.nbytes for w in compressed_weights(model))
    rest = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers())
    assert report.converted == 9 and report.bytes_after == compressed_total + rest
    # Everything alive is the compressed weights plus norms/buffers, the decode buffers reserved at
    # their final sizes and small codec scratch.
    from neutrain.nn import DECODE_BUFFERS

    decode = DECODE_BUFFERS.nbytes()
    assert live <= 1.05 * (compressed_total + rest) + decode + 64 * 1024, (live, compressed_total, rest, decode)
    assert live - decode < dense_total
    assert report.bits_per_weight < 15


@pytest.mark.slow
def test_state_dict_round_trip_of_compressed_model_and_optimizer(tmp_path):
    _, model = dense_and_compressed()
    data = token_batches(4, seed=9)
    make = lambda m: AdaLomo(m.parameters(), lr=1e-2, clip_mode="global_stale", max_grad_norm=1.0, seed=5)  # noqa: E731
    opt = make(model)
    train(model, opt, data[:2])
    save_file(model.state_dict(), tmp_path / "model.safetensors")
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    train(model, opt, data[2:])

    _, resumed = dense_and_compressed(seed=1)
    resumed.load_state_dict(load_file(tmp_path / "model.safetensors"))
    opt2 = make(resumed)
    opt2.load_state_dict(torch.load(tmp_path / "optimizer.pt"))
    train(resumed, opt2, data[2:])
    a, b = weights(model), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_load_compressed_and_init_compressed(tmp_path):
    for tie in (False, True):
        dense = tiny_llama(tie=tie)
        dense.save_pretrained(tmp_path / str(tie))
        model, report = load_compressed(tmp_path / str(tie), device="cpu", progress=False, codec_options=CODEC)
        assert isinstance(model.lm_head, CompressedLinear) and report.converted == (15 if tie else 16)
        if tie:
            assert model.lm_head.compressed is model.model.embed_tokens.compressed
        expected = dense.state_dict()
        loaded = decompressed_state_dict(model)
        assert all(torch.equal(loaded[k], expected[k]) for k in loaded)
        ids = token_batches(1)[0]
        assert torch.equal(model(ids).logits, dense(ids).logits)
    random_model, report = init_compressed(dense.config, device="cpu", progress=False, codec_options=CODEC)
    assert report.converted == 15 and random_model.lm_head.compressed is random_model.model.embed_tokens.compressed
    w = random_model.model.layers[0].mlp.up_proj.weight.float()
    assert abs(w.std().item() - dense.config.initializer_range) < 0.003


def test_dense_mode_is_a_no_op_and_trains_with_the_same_api():
    model = tiny_llama()
    before = copy.deepcopy(model.state_dict())
    report = compress_model(model, weights="dense", progress=False)
    assert report.converted == 0 and report.bytes_before == report.bytes_after
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    train(model, AdaLomo(model.parameters(), lr=1e-2), token_batches(1))
    assert not torch.equal(before["model.layers.0.mlp.up_proj.weight"], model.model.layers[0].mlp.up_proj.weight)
