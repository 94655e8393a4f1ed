"""One build path: every source (random init, a one-shard and a sharded Hugging Face folder, GGUF, a
neutrain checkpoint) builds dense, compressed and compressed-and-offloaded through the same
interface (``build(spec.replace(placement=...))``), and the compressed models decode to the dense
one bit for bit. The sink hands a layer to host memory only once all of its tensors are in, in
whatever order a source delivers them."""

import json
import zlib

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from neutrain.errors import CheckpointError
from neutrain.nn import CompressedLinear, decompressed_state_dict
from neutrain.nn.checkpoint import save_compressed_checkpoint
from neutrain.nn.load import build
from neutrain.nn.model_spec import ModelSpec, Placement
from neutrain.nn.sink import ModelSink
from neutrain.nn.sources import NeutrainCheckpoint, RandomInit, SafetensorsFolder
from neutrain.nn.weight_offload_model import weight_store

from .nn_helpers import CODEC

LAYERS = 3
PLACEMENTS = {"dense": Placement("dense"), "compressed": Placement("neuzip-lossless"),
              "offloaded": Placement("neuzip-lossless", offload=True)}


def _config(tie=False, vocab=96):
    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=2,
                       num_key_value_heads=1, vocab_size=vocab, max_position_embeddings=64, tie_word_embeddings=tie)


def _dense_model(tie=False):
    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(_config(tie), dtype=torch.bfloat16)


def _split_layers(state: dict, path, shards: int) -> None:
    """Write ``state`` as ``shards`` files that each hold a share of every layer, in no layer order (with an index)."""
    names = sorted(state, key=lambda n: (zlib.crc32(n.encode()) % 7, n))  # neither alphabetical nor by layer
    files = {name: f"model-{i % shards + 1:05d}-of-{shards:05d}.safetensors" for i, name in enumerate(names)}
    for file in sorted(set(files.values())):
        save_file({n: state[n].contiguous() for n in names if files[n] == file}, str(path / file), metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": files}))


def _source(kind: str, tmp_path):
    """``(spec with a dense placement, the reference weights or None)`` for each kind of source."""
    if kind == "random":
        return ModelSpec(RandomInit(seed=5), _config(), torch.bfloat16, codec_options=CODEC), None
    if kind in ("hf-one-shard", "hf-sharded"):
        model = _dense_model(tie=kind == "hf-one-shard")
        model.save_pretrained(tmp_path)
        if kind == "hf-sharded":
            for file in tmp_path.glob("*.safetensors"):
                file.unlink()
            _split_layers(model.state_dict(), tmp_path, shards=3)
        source = SafetensorsFolder(tmp_path)
        return ModelSpec(source, source.read_config(), torch.bfloat16, codec_options=CODEC), model.state_dict()
    if kind == "gguf":
        pytest.importorskip("gguf")
        from neutrain.nn.gguf import GGUFFile
        from tests.gguf_writer import tiny_llama, tiny_tokenizer, write_gguf

        tok = tiny_tokenizer()
        path = write_gguf(tmp_path / "tiny-q8_0.gguf", tiny_llama(len(tok)), tok, "Q8_0")
        source = GGUFFile(str(tmp_path), path.name)
        return ModelSpec(source, source.read_config(), torch.bfloat16, codec_options=CODEC), None
    assert kind == "neutrain-checkpoint"
    trained, _ = build(ModelSpec(RandomInit(seed=7), _config(tie=True), torch.bfloat16, codec_options=CODEC,
                                 placement=PLACEMENTS["compressed"]), progress=False)
    save_compressed_checkpoint(trained, tmp_path, "neuzip-lossless")
    source = NeutrainCheckpoint(tmp_path)
    return ModelSpec(source, source.read_config(), torch.bfloat16), decompressed_state_dict(trained)


def _equal(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["random", "hf-one-shard", "hf-sharded", "gguf", "neutrain-checkpoint"])
def test_every_source_builds_every_placement_and_decodes_to_the_dense_model(kind, tmp_path):
    spec, reference = _source(kind, tmp_path)
    built = {name: build(spec.replace(placement=placement), progress=False)[0] for name, placement in PLACEMENTS.items()}
    dense = built["dense"].state_dict()
    if reference is not None:  # the source's own weights, as they were written
        assert _equal(dense, reference) == []
    assert not any(isinstance(m, CompressedLinear) for m in built["dense"].modules())
    for name in ("compressed", "offloaded"):
        model = built[name]
        assert isinstance(model.model.layers[0].mlp.down_proj, CompressedLinear), name
        assert _equal(decompressed_state_dict(model), dense) == [], name
    store = weight_store(built["offloaded"])
    assert weight_store(built["compressed"]) is None and store is not None
    layers = len(built["dense"].model.layers)
    assert [len(layer.weights) for layer in store.layers] == [7] * layers  # each layer once, whole
    ids = torch.randint(0, 90, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = built["dense"].eval()(ids).logits
        for name in ("compressed", "offloaded"):
            assert torch.equal(built[name].eval()(ids).logits, logits), name


def test_a_layer_goes_to_host_memory_exactly_when_its_last_tensor_arrives():
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        skeleton = AutoModelForCausalLM.from_config(_config(), dtype=torch.bfloat16)
    tensors = list(RandomInit().tensors(skeleton, "cpu", torch.bfloat16))
    order = torch.randperm(len(tensors), generator=torch.Generator().manual_seed(3)).tolist()
    sink = ModelSink(skeleton, Placement("neuzip-lossless", offload=True), codec_options=CODEC)
    left = {i: {n for n, _ in tensors if n.startswith(f"model.layers.{i}.")} for i in range(LAYERS)}
    handed = []
    for index in order:
        name, tensor = tensors[index]
        sink.put(name, tensor)
        for i, names in left.items():
            names.discard(name)
            if not names and i not in handed:
                handed.append(i)
        offloaded = [int(layer.weights[0].name.split(".")[2]) for layer in sink.store.layers]
        assert offloaded == handed, name  # in the order they completed, and none before
    model, _ = sink.finish()
    assert weight_store(model) is sink.store and len(sink.store.layers) == LAYERS


def test_the_placement_names_which_modules_go_to_host_memory():
    host = ("model.layers.1",)  # a partial offload: one layer stays on the device
    spec = ModelSpec(RandomInit(), _config(), torch.bfloat16, codec_options=CODEC,
                     placement=Placement("neuzip-lossless", offload=True, host=host))
    store = weight_store(build(spec, progress=False)[0])
    assert len(store.layers) == 1 and len(store.layers[0].weights) == 7
    assert all(w.name.startswith("model.layers.1.") for w in store.layers[0].weights)
    with pytest.raises(AttributeError):  # an unknown module fails before anything is read
        build(spec.replace(placement=Placement("neuzip-lossless", offload=True, host=("model.layers.9",))))
    with pytest.raises(ValueError, match="needs neuzip-lossless"):
        Placement("dense", offload=True)


def test_a_tensor_in_two_shards_is_refused(tmp_path):
    state = _dense_model().state_dict()
    names = sorted(state)
    save_file({n: state[n] for n in names[:10]}, str(tmp_path / "a.safetensors"))
    save_file({n: state[n] for n in names[9:]}, str(tmp_path / "b.safetensors"))  # names[9] in both
    _config().save_pretrained(tmp_path)
    source = SafetensorsFolder(tmp_path)
    spec = ModelSpec(source, source.read_config(), torch.bfloat16, codec_options=CODEC)
    with pytest.raises(CheckpointError, match=rf"^checkpoint tensor {names[9]} appears twice$"):
        build(spec, progress=False)


@pytest.mark.gpu
def test_an_offloaded_build_on_cuda_from_shards_decodes_and_computes_as_the_resident_one(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; run on the device machine")
    spec, reference = _source("hf-sharded", tmp_path)
    resident, _ = build(spec.replace(placement=Placement("neuzip-lossless", device="cuda")), progress=False)
    offloaded, _ = build(spec.replace(placement=Placement("neuzip-lossless", offload=True, device="cuda")),
                         progress=False)
    store = weight_store(offloaded)
    assert store.cuda and [len(layer.weights) for layer in store.layers] == [7] * LAYERS
    decoded = {k: v.cpu() for k, v in decompressed_state_dict(offloaded).items()}
    assert _equal(decoded, reference) == []
    ids = torch.randint(0, 90, (2, 9), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        assert torch.equal(offloaded.eval()(ids).logits, resident.eval()(ids).logits)
