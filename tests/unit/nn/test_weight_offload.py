"""Weight offload: decoder layers' compressed payloads live in host memory; training is bit for bit unchanged."""

import io

import pytest
import torch

from neutrain.nn import (
    CompressedWeight,
    causal_lm_loss,
    compress_model,
)
from neutrain.nn.checkpoint import load_compressed_state, save_compressed_checkpoint
from neutrain.nn.convert import compressed_weights
from neutrain.nn.weight_offload import PAYLOAD, WeightOffload
from neutrain.nn.weight_offload_model import offload_weights, weight_store
from neutrain.optim import LOMO, AdaLomo

from .nn_helpers import (
    CODEC,
    dense_and_compressed,
    enable_checkpointing,
    tiny_llama,
    token_batches,
    weights,
)

LAYERS = 3


def _model(offload, checkpointing=True, ahead=1, slots=2):
    model = tiny_llama(seed=3, layers=LAYERS)
    compress_model(model, progress=False, codec_options=CODEC)
    if checkpointing:
        enable_checkpointing(model)
    store = offload_weights(model, ahead=ahead, slots=slots) if offload else None
    return model, store


def _optimizer(model, rule):
    if rule == "lomo":
        opt = LOMO(model.parameters(), lr=0.05, stochastic_rounding=False, clip_mode="per_tensor", max_grad_norm=1.0)
    else:
        opt = AdaLomo(model.parameters(), lr=0.05, stochastic_rounding=False)
    return opt.bind(model)


def _steps(model, opt, data):
    for ids in data:
        opt.backward(causal_lm_loss(model, ids, ids))
        opt.step()


def _blobs(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [True, False], ids=["ckpt", "no-ckpt"])
@pytest.mark.parametrize("rule", ["lomo", "adalomo"])
def test_offloaded_training_is_bit_identical(rule, checkpointing):
    data = token_batches(3, seed=5)
    plain, _ = _model(offload=False, checkpointing=checkpointing)
    _steps(plain, _optimizer(plain, rule), data)
    offloaded, store = _model(offload=True, checkpointing=checkpointing)
    _steps(offloaded, _optimizer(offloaded, rule), data)
    layer_weights = sum(len(layer.weights) for layer in store.layers)
    assert layer_weights == 7 * len(offloaded.model.layers)
    # Two slots for three layers: each step evicts and fetches again (the first step 4 loads, then 2 each:
    # the layers at the turns stay), and each update is written back.
    assert store.stats.loads == len(store.layers) + 1 + 2 * (len(data) - 1)
    assert store.stats.writebacks == len(data) * layer_weights and store.stats.d2h_bytes > 0
    _assert_same(weights(plain), weights(offloaded))
    _assert_same(_blobs(plain), _blobs(offloaded))  # the compressed bytes too (saved from the host store)


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [True, False], ids=["ckpt", "no-ckpt"])
@pytest.mark.parametrize("rule", ["lomo", "adalomo"])
def test_some_layers_offloaded_train_bit_identically_to_none(rule, checkpointing):
    # memory.offload_layers: 2 of 5 layers in host memory (layers 1 and 3), the other three stay on the
    # device; after three steps every weight and every compressed byte equals the all-resident run's.
    data = token_batches(3, seed=11)
    plain = tiny_llama(seed=4, layers=5)
    compress_model(plain, progress=False, codec_options=CODEC)
    partial = tiny_llama(seed=4, layers=5)
    compress_model(partial, progress=False, codec_options=CODEC)
    if checkpointing:
        enable_checkpointing(plain), enable_checkpointing(partial)
    store = offload_weights(partial, count=2)
    held = {w.name.split(".")[2] for layer in store.layers for w in layer.weights}
    assert held == {"1", "3"} and (store.ahead, store.slots) == (1, 2)
    for index, layer in enumerate(partial.model.layers):  # the others keep their payload on the device
        homes = {w.home for w in compressed_weights(layer)}
        assert homes == ({store} if index in (1, 3) else {None}), index
    _steps(plain, _optimizer(plain, rule), data)
    _steps(partial, _optimizer(partial, rule), data)
    assert store.stats.writebacks == len(data) * 2 * 7  # only the offloaded layers' updates go back
    _assert_same(weights(plain), weights(partial))
    _assert_same(_blobs(plain), _blobs(partial))


@pytest.mark.slow
def test_a_streaming_build_offloads_only_the_placements_layers():
    from transformers import LlamaConfig

    from neutrain.nn.load import build, init_compressed
    from neutrain.nn.model_spec import ModelSpec, Placement
    from neutrain.nn.sources import RandomInit
    from neutrain.config.layer_placement import LayerPlacement
    from neutrain.nn.weight_offload_model import weight_store

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64)
    assert LayerPlacement.spread(cfg.num_hidden_layers, 3).offloaded == (1, 3, 5)
    spec = ModelSpec(RandomInit(seed=1), cfg, torch.bfloat16, codec_options=CODEC,
                     placement=Placement("neuzip-lossless", offload=True, layers=3))
    built, _ = build(spec, progress=False)
    store = weight_store(built)
    plain, _ = init_compressed(cfg, device="cpu", progress=False, codec_options=CODEC, seed=1)
    assert [layer.weights[0].name.split(".")[2] for layer in store.layers] == ["1", "3", "5"]
    assert (store.ahead, store.slots) == (1, 2)  # the spread placement's ring, as the planner counts it
    assert all(w.home is None for i in (0, 2, 4) for w in compressed_weights(built.model.layers[i]))
    data = [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    _steps(plain, _optimizer(plain, "lomo"), data)
    _steps(built, _optimizer(built, "lomo"), data)
    _assert_same(_blobs(plain), _blobs(built))


@pytest.mark.parametrize("count, offloaded, ring", [
    (1, (16,), (1, 2)), (8, (2, 6, 10, 14, 18, 22, 26, 30), (1, 2)), (16, tuple(range(1, 32, 2)), (1, 2)),
    (17, None, (2, 4)), (32, tuple(range(32)), (2, 4)),
])
def test_a_placement_spreads_its_layers_and_sizes_its_ring(count, offloaded, ring):
    from neutrain.config.layer_placement import LayerPlacement

    placement = LayerPlacement.spread(32, count)
    assert placement.count == count == len(set(placement.offloaded))
    assert list(placement.offloaded) == sorted(placement.offloaded) and 0 <= placement.offloaded[0]
    assert placement.offloaded[-1] < 32
    if offloaded is not None:
        assert placement.offloaded == offloaded
    assert (placement.ahead, placement.slots) == ring
    for bad in (0, 33):
        with pytest.raises(ValueError, match=f"cannot offload {bad} of 32 decoder layers"):
            LayerPlacement.spread(32, bad)


@pytest.mark.slow
def test_offloaded_layers_hold_no_device_payload_between_uses():
    model, store = _model(offload=True)
    resident = [layer for layer in store.layers if layer.slot is not None]
    assert not resident  # nothing fetched yet
    for weight in (w for layer in store.layers for w in layer.weights):
        assert all(getattr(weight.ct, name).numel() == 0 for name in PAYLOAD)
        assert weight.home is store and weight_store(model) is store
    assert store.host_bytes > 0 and store.device_bytes == 0
    _steps(model, _optimizer(model, "lomo"), token_batches(1, seed=1))
    assert sum(layer.slot is not None for layer in store.layers) <= store.slots
    assert store.device_bytes > 0


@pytest.mark.slow
def test_resume_with_offload_equals_the_uninterrupted_run(tmp_path):
    data = token_batches(4, seed=7)
    straight, _ = _model(offload=True)
    _steps(straight, _optimizer(straight, "adalomo"), data)

    first, _ = _model(offload=True)
    opt = _optimizer(first, "adalomo")
    _steps(first, opt, data[:2])
    save_compressed_checkpoint(first, tmp_path, "neuzip-lossless")
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)

    resumed, store = _model(offload=True, slots=3)
    diverge = _optimizer(resumed, "lomo")
    _steps(resumed, diverge, token_batches(1, seed=99))  # diverge first: the load must overwrite every byte
    diverge.unbind()
    load_compressed_state(resumed, tmp_path)
    assert all(layer.slot is None for layer in store.layers)  # the load went to the host store
    opt = _optimizer(resumed, "adalomo")
    buffer.seek(0)
    opt.load_state_dict(torch.load(buffer, weights_only=True))
    _steps(resumed, opt, data[2:])
    _assert_same(_blobs(straight), _blobs(resumed))


def test_a_grown_payload_survives_eviction():
    from neutrain.compress import compress

    torch.manual_seed(0)
    small = [CompressedWeight(compress(torch.randn(64, 64).bfloat16() * 0.01, steps=16), name=f"w{i}")
             for i in range(3)]
    store = WeightOffload("cpu", ahead=0, slots=2)
    for weight in small:
        store.add_layer([weight])
    before = small[0]._host["stream"].numel()
    wide = (torch.randn(64, 64) * torch.logspace(-20, 20, 64)).bfloat16()  # far more exponent entropy
    small[0].write_(wide)
    assert small[0]._host["stream"].numel() > before  # the host buffer grew with the stream
    small[1].dense(), small[2].dense()  # two other layers take both slots: layer 0 is evicted
    assert store.layers[0].slot is None
    assert torch.equal(small[0].dense(), wide)  # fetched again from the host store, every byte there
    assert small[0].saved_ct().state_dict()["stream"].numel() == small[0].ct.stream_words


def test_fetching_ahead_follows_the_pass_direction():
    model, store = _model(offload=True, checkpointing=False, ahead=1, slots=3)
    store.stats.reset()
    with torch.no_grad():
        model(token_batches(1)[0])
    # Forward: layer 0 stalls, each later layer was fetched ahead.
    assert store.stats.stalls == 1 and store.stats.loads == len(store.layers)


def test_offload_refuses_a_model_without_compressed_layers():
    dense, _ = dense_and_compressed()
    with pytest.raises(ValueError, match="neuzip-lossless"):
        offload_weights(dense)


def test_a_corrupted_layer_blob_is_named_when_loading_into_host_memory(tmp_path):
    from safetensors.torch import load_file, save_file

    from neutrain.errors import CheckpointError

    model, _ = _model(offload=True)
    save_compressed_checkpoint(model, tmp_path, "neuzip-lossless")
    path = tmp_path / "model.safetensors"
    state = load_file(str(path))
    key = "model.layers.1.mlp.up_proj.weight.tails"
    state[key][0] ^= 1
    save_file(state, str(path), metadata={"aliases": "{}", "format": "neuzip-blobs"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_compressed_state(_model(offload=True)[0], tmp_path)
    del state["model.layers.2.self_attn.k_proj.weight.stream"]
    state[key][0] ^= 1
    save_file(state, str(path), metadata={"aliases": "{}", "format": "neuzip-blobs"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.self_attn\.k_proj\.weight"):
        load_compressed_state(_model(offload=True)[0], tmp_path)


def test_streamed_safetensors_file_reads_back_like_save_file(tmp_path):
    from safetensors import safe_open

    from neutrain.nn.weight_offload_model import write_safetensors

    tensors = {"i32": torch.arange(5, dtype=torch.int32), "u8": torch.arange(7, dtype=torch.uint8),
               "i64": torch.arange(3), "bf16": torch.randn(2, 3).bfloat16(), "empty": torch.zeros(0),
               "view": torch.arange(10, dtype=torch.int16)[2:6]}
    write_safetensors(tensors, tmp_path / "a.safetensors", {"format": "x"})
    with safe_open(str(tmp_path / "a.safetensors"), framework="pt") as fh:
        assert fh.metadata() == {"format": "x"} and set(fh.keys()) == set(tensors)
        for name, t in tensors.items():
            assert torch.equal(fh.get_tensor(name), t), name
    assert not list(tmp_path.glob("*.tmp"))


def test_saving_an_offloaded_model_reads_the_host_store_without_copies():
    model, store = _model(offload=True)
    blob = model.state_dict()["model.layers.0.mlp.up_proj.weight.tails"]
    host = store.layers[0].weights[5]._host["tails"]  # q, k, v, o, gate, up, down
    assert blob.data_ptr() == host.data_ptr()
