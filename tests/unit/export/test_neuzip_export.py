"""NeuZip export and the ``neuzip`` quantizer: round trips, from_pretrained, loud failures."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import neutrain  # noqa: F401  (registers the quantizer)
from neutrain.errors import UserInputError
from neutrain.export.neuzip import export_neuzip, parse_format, parse_size

REPO = Path(__file__).resolve().parents[3]
FAST = {"steps": 8}  # short lanes: the CPU reference decoder's cost grows with steps


def _tiny(tie=False, dtype=torch.bfloat16, vocab=96):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, tie_word_embeddings=tie)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    with torch.no_grad():
        for p in model.parameters():  # non-trivial norms and weights: nothing equal by accident
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _load(path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), **kwargs)


def test_format_and_size_parsing():
    assert parse_format("neuzip") is None and parse_format("neuzip-lossless") is None
    assert [parse_format(f"neuzip-lossy-{k}") for k in (0, 1, 3, 7)] == [0, 1, 3, 7]
    for bad in ("neuzip-lossy-2", "neuzip-lossy", "hf", "zip"):
        with pytest.raises(UserInputError):
            parse_format(bad)
    assert parse_size("5GB") == 5 * 10**9 and parse_size("100KB") == 10**5 and parse_size("2MiB") == 2 << 20
    with pytest.raises(UserInputError):
        parse_size("lots")


@pytest.mark.slow
@pytest.mark.parametrize("tie", [False, True])
def test_lossless_export_from_pretrained_is_compressed_and_bit_exact(tmp_path, tie):
    from neutrain.export.inference import ChunkedHeadLinear
    from neutrain.nn import CompressedEmbedding, CompressedLinear, compressed_weights, decompressed_state_dict

    model = _tiny(tie=tie)
    dense = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        ref = model(ids).logits
    out = export_neuzip(model, tmp_path / "nz", max_shard_size="20KB", codec_options=FAST)
    files = os.listdir(out)
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1
    qc = json.loads((Path(out) / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "neuzip" and qc["mantissa_bits"] is None and "lm_head" in qc["modules"]

    loaded = _load(out)
    assert type(loaded.model.layers[1].mlp.down_proj) is CompressedLinear
    assert type(loaded.model.embed_tokens) is CompressedEmbedding and type(loaded.lm_head) is ChunkedHeadLinear
    assert loaded.is_quantized and loaded.config.quantization_config.quant_method == "neuzip"
    assert all(not w.trainable for w in compressed_weights(loaded))
    # A tied pair is written twice but shares one compressed tensor after loading.
    assert (loaded.lm_head.compressed is loaded.model.embed_tokens.compressed) == tie
    decoded = decompressed_state_dict(loaded)
    for name, value in dense.items():
        assert torch.equal(decoded[name].view(torch.int16), value.view(torch.int16)), name
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ref)
    gen = loaded.generate(ids[:1], max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        expected = model.generate(ids[:1], max_new_tokens=4, do_sample=False)
    assert torch.equal(gen, expected)


def test_dequantize_gives_the_dense_model(tmp_path):
    model = _tiny()
    loaded = _load(export_neuzip(model, tmp_path / "nz", codec_options=FAST))
    dense = loaded.dequantize()
    assert type(dense.lm_head) is torch.nn.Linear and not getattr(dense, "is_quantized", False)
    for name, value in model.state_dict().items():
        assert torch.equal(dense.state_dict()[name], value), name


def test_lossy_export_takes_k_and_rounds_like_the_codec(tmp_path):
    from neutrain.compress import compress
    from neutrain.nn import decompressed_state_dict

    model = _tiny()
    w = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    out = export_neuzip(model, tmp_path / "lossy", mantissa_bits=1, codec_options=FAST)
    loaded = _load(out)
    assert loaded.config.quantization_config.mantissa_bits == 1
    got = decompressed_state_dict(loaded)["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(got, compress(w, 1).decompress())
    assert not torch.equal(got, w)
    assert (got.view(torch.int16) & 0x3F).eq(0).all()  # only 1 of 7 mantissa bits survives
    # The lossy export is smaller on disk than the lossless one.
    lossless = export_neuzip(model, tmp_path / "lossless", codec_options=FAST)
    size = lambda d: sum(f.stat().st_size for f in Path(d).glob("*.safetensors"))  # noqa: E731
    assert size(out) < size(lossless)


@pytest.mark.slow
def test_a_dropped_model_is_freed(tmp_path):
    import gc
    import weakref

    from neutrain.nn import compressed_weights

    loaded = _load(export_neuzip(_tiny(), tmp_path / "nz", codec_options=FAST))
    with torch.no_grad():
        loaded(torch.randint(0, 96, (1, 5)))  # decode buffers and the prefetcher have seen every weight
    streams = [weakref.ref(w.ct.stream) for w in compressed_weights(loaded)]
    del loaded
    gc.collect()
    assert streams and all(ref() is None for ref in streams), "process-wide state keeps a dropped model alive"


def test_corrupted_blob_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    out = Path(export_neuzip(_tiny(), tmp_path / "nz", codec_options=FAST))
    state = load_file(str(out / "model.safetensors"))
    key = "model.layers.1.mlp.up_proj.weight.stream"
    state[key] = state[key].clone()
    state[key][3] ^= 1
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(Exception, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        _load(out)


def _run(code, cwd):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_import_neutrain_stays_light_and_registers_lazily(tmp_path):
    res = _run("import sys, neutrain; heavy = [m for m in ('torch', 'transformers', 'triton') if m in sys.modules]; "
               "print(heavy)\n"
               "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING as M; print('neuzip' in M)", tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["[]", "True"], res.stdout


REGISTRATION_ORDERS = ("neutrain.export.quantizer", "transformers.quantizers.auto", "neutrain.export.hf",
                       "neutrain.export.neuzip", "neutrain.cli.generate", "transformers")


def test_the_method_is_registered_whichever_module_is_imported_first(tmp_path):
    """The quantizer module imports transformers' registry, whose import hook imported the half-made quantizer
    module again: when a command (``neutrain generate``) imported the quantizer first, nothing was registered
    and every NeuZip export failed to load. Each order runs in a fresh interpreter state (one process, the
    modules purged between orders)."""
    code = f"""
import sys
from neutrain.export import registration
for first in {REGISTRATION_ORDERS!r}:
    for name in [m for m in sys.modules if m.startswith(("neutrain.export", "neutrain.cli", "transformers.quantizers"))]:
        del sys.modules[name]
    sys.modules.pop("neutrain.export", None)
    import neutrain.export.registration as registration
    registration.install()
    __import__(first)
    import transformers.quantizers.auto as auto
    print(first, "neuzip" in auto.AUTO_QUANTIZER_MAPPING and "neuzip" in auto.AUTO_QUANTIZATION_CONFIG_MAPPING)
"""
    res = _run(code, tmp_path)
    assert res.returncode == 0, res.stderr
    assert "could not register" not in res.stderr, res.stderr
    assert res.stdout.split() == [w for first in REGISTRATION_ORDERS for w in (first, "True")], res.stdout


@pytest.mark.slow
def test_loading_without_neutrain_fails_loudly(tmp_path):
    out = export_neuzip(_tiny(), tmp_path / "nz", codec_options=FAST)
    res = _run(f"from transformers import AutoModelForCausalLM\nAutoModelForCausalLM.from_pretrained({str(out)!r})",
               tmp_path)
    assert res.returncode != 0, "a NeuZip export loaded as a dense model without neutrain"
    assert "ignore_mismatched_sizes" in res.stderr
    assert "Unknown quantization type, got neuzip" in res.stderr


def test_quantizer_refuses_quantizing_a_dense_model_on_load(tmp_path):
    from neutrain.export.quantizer import NeuZipConfig

    model = _tiny()
    model.save_pretrained(str(tmp_path / "dense"))
    with pytest.raises(ValueError, match="pre-quantized"):
        _load(tmp_path / "dense", quantization_config=NeuZipConfig())


def test_chunked_head_rows_end_on_tile_boundaries():
    from neutrain.compress import compress
    from neutrain.export.inference import aligned_rows

    ct = compress(torch.randn(300, 96).bfloat16(), steps=8)
    tile = ct.steps * ct.lanes * ct.elems
    rows = aligned_rows(ct, 96, target=4 * tile)
    assert rows and rows * 96 % tile == 0 and rows * 96 <= 4 * tile
    assert aligned_rows(ct, 96, target=tile // 4) is None  # one aligned unit is already too big


@pytest.mark.gpu
@pytest.mark.parametrize("mantissa_bits", [None, 3])
def test_from_pretrained_on_the_gpu_decodes_the_head_in_chunks(tmp_path, mantissa_bits):
    from neutrain.export import inference
    from neutrain.nn import compress_model

    model = _tiny(vocab=3000).cuda()
    compress_model(model.requires_grad_(False), progress=False, mantissa_bits=mantissa_bits)
    ids = torch.randint(0, 3000, (2, 7), device="cuda")
    with torch.no_grad():
        ref = model.eval()(ids).logits
    out = export_neuzip(model, tmp_path / "nz", mantissa_bits=mantissa_bits)
    loaded = _load(out)
    assert loaded.lm_head.compressed.device.type == "cuda"
    old = inference.CHUNK_ELEMENTS
    inference.CHUNK_ELEMENTS = 1 << 16  # several blocks for this small head
    try:
        before = inference.COUNTERS["chunked_head"]
        with torch.no_grad():
            got = loaded(ids).logits
        assert inference.COUNTERS["chunked_head"] > before
    finally:
        inference.CHUNK_ELEMENTS = old
    assert torch.allclose(got.float(), ref.float(), atol=2e-2, rtol=1e-2)
    # The head's blocks are exactly the rows of the full decode.
    head = loaded.lm_head
    rows = inference.aligned_rows(head.compressed.ct, 32, target=1 << 16)
    block = inference.decode_rows_block(head.compressed.ct, rows, head.out_features, 32)
    assert torch.equal(block, head.compressed.dense()[rows:])
    assert loaded.generate(ids[:1], max_new_tokens=4, do_sample=False).shape == (1, 11)
