"""Every saved form a model leaves (a NeuZip export, lossless or lossy, sharded anywhere; a dense export) placed
in every form ``neutrain generate`` builds on a GPU (compressed, compressed with layers streamed from host
memory), through the one chooser of formats (``neutrain.nn.formats.folder_format``).

Why: the GPU placement read a NeuZip export as a plain Hugging Face folder, so ``neutrain generate`` of the 70B
export failed on the GPU, budget or none ("model.embed_tokens.weight has shape (1,)"), while the CPU (which
loads through transformers' ``from_pretrained``) worked. Here the builds run on the CPU: the placement code is
the GPU's, only the device differs.
"""

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import neutrain  # noqa: F401  (registers the quantizer)
from neutrain.cli.placement import build_form, resolve
from neutrain.export import load_checkpoint_model
from neutrain.export.neuzip import export_neuzip
from neutrain.nn.formats import folder_format
from neutrain.nn.sources import NeuZipExport, NeutrainCheckpoint, SafetensorsFolder

FAST = {"steps": 8}
FORMS = ("neuzip", "neuzip+offload")


def _tiny(vocab=96):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _logits(model):
    with torch.no_grad():
        return model(torch.tensor([[1, 5, 9, 33, 2]])).logits


@pytest.fixture(scope="module")
def model():
    return _tiny()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("mantissa_bits", [None, 3])
def test_a_neuzip_export_builds_in_every_generate_form_as_transformers_loads_it(tmp_path, model, form, mantissa_bits):
    out = Path(export_neuzip(model, tmp_path / "nz", mantissa_bits=mantissa_bits, max_shard_size="24KB",
                             codec_options=FAST))
    assert len(list(out.glob("*.safetensors"))) > 1  # sharded: some weight's blobs straddle two files
    fmt = folder_format(out)
    assert isinstance(fmt.source(), NeuZipExport) and fmt.encoded
    built = build_form(out, form, device="cpu")
    reference, _ = load_checkpoint_model(out)  # transformers' from_pretrained through the quantizer
    assert torch.equal(_logits(built), _logits(reference))
    if mantissa_bits is None:
        assert torch.equal(_logits(built), _logits(model))  # lossless: the model itself


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shard_kib=st.integers(min_value=4, max_value=80))
def test_any_shard_size_gives_the_same_model(tmp_path_factory, model, shard_kib):
    out = Path(export_neuzip(model, tmp_path_factory.mktemp("nz") / "nz", max_shard_size=f"{shard_kib}KB",
                             codec_options=FAST))
    assert torch.equal(_logits(build_form(out, "neuzip+offload", device="cpu")), _logits(model))


def test_each_folder_gets_the_loader_of_its_format(tmp_path, model):
    dense = tmp_path / "dense"
    model.save_pretrained(str(dense))
    assert type(folder_format(dense).source()) is SafetensorsFolder and not folder_format(dense).encoded
    nz = Path(export_neuzip(model, tmp_path / "nz", codec_options=FAST))
    assert type(folder_format(nz).source()) is NeuZipExport
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "neutrain_weights.json").write_text('{"weights": "neuzip-lossless"}')
    assert type(folder_format(tmp_path / "ckpt").source()) is NeutrainCheckpoint


def test_the_placement_counts_a_neuzip_export_as_compressed(tmp_path, model):
    """The decision reads the files' bytes as the compressed form: a dense reading would plan for the dense
    model where the export is a fraction of it."""
    nz = Path(export_neuzip(model, tmp_path / "nz", codec_options=FAST))
    dense = tmp_path / "dense"
    model.save_pretrained(str(dense))
    assert resolve(nz, None, prompt_tokens=8, new_tokens=8).form != "dense"
    assert resolve(dense, None, prompt_tokens=8, new_tokens=8).form == "dense"


def test_a_run_trains_from_a_neuzip_export_as_from_the_dense_model(tmp_path):
    """``model.base_model`` may be a NeuZip export (a compressed model passed on): the first step's loss is
    the dense model's, to the bit."""
    import json

    import yaml
    from transformers import AutoModelForCausalLM, LlamaConfig

    from neutrain.cli import main
    from tests.helpers import TINY_LLAMA, TINY_RECIPE

    torch.manual_seed(1)
    cfg = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}, vocab_size=259)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(str(tmp_path / "dense"))
    export_neuzip(model, tmp_path / "nz", codec_options=FAST)
    losses = {}
    for base in ("dense", "nz"):
        recipe = {**TINY_RECIPE, "model": {"init": "pretrained", "base_model": str(tmp_path / base), "tokenizer": "byte",
                                           "dtype": "bfloat16"},
                  "train": {**TINY_RECIPE["train"], "output_dir": str(tmp_path / f"run_{base}"), "max_steps": 1,
                            "save_steps": 1, "optimizer": "lomo"},
                  "memory": {"weights": "neuzip-lossless"}, "eval": {"perplexity": False}, "export": {"format": "none"}}
        (tmp_path / f"{base}.yaml").write_text(yaml.safe_dump(recipe))
        assert main(["train", str(tmp_path / f"{base}.yaml")]) == 0
        rows = [json.loads(line) for line in (tmp_path / f"run_{base}" / "metrics.jsonl").read_text().splitlines()]
        losses[base] = [r["loss"] for r in rows if "loss" in r]
    assert losses["nz"] and losses["nz"] == losses["dense"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the device machine")
@pytest.mark.parametrize("form", FORMS)
def test_on_a_gpu_each_form_of_a_neuzip_export_gives_the_models_logits(tmp_path, model, form):
    """Where the 70B export failed: the GPU placement's own build, on the GPU."""
    out = Path(export_neuzip(model, tmp_path / "nz", max_shard_size="24KB", codec_options=FAST))
    built = build_form(out, form, device="cuda")
    with torch.no_grad():
        got = built(torch.tensor([[1, 5, 9, 33, 2]], device="cuda")).logits.cpu()
    torch.testing.assert_close(got, _logits(model), atol=2e-2, rtol=2e-2)  # GPU kernels: another summation order


def test_one_placement_picks_the_loader_and_parses_the_config_once(tmp_path, model, monkeypatch):
    """One placement (the decision, its line and the build) reads the folder once and hands what it read down.

    Why: each layer read it again, so one ``neutrain generate`` chose the folder's loader three times and parsed its
    config.json seven times. Two parses remain, each needed once: the loader's choice reads the JSON itself (a
    NeuZip export is told by its ``quantization_config``), and transformers parses it into the model's config."""
    import neutrain.cli.placement as placement
    import neutrain.nn.formats as formats
    from neutrain.cli.placement import place_on

    out = Path(export_neuzip(model, tmp_path / "nz", codec_options=FAST))
    chosen, parsed = [], []

    def counted_source(path):
        chosen.append(path)
        return folder_format(path)

    def counted_json(reader):
        def read(path, *args, **kwargs):
            if Path(path).name == "config.json":
                parsed.append("json")
            return reader(path, *args, **kwargs)
        return read

    def counted_config(self, *args, **kwargs):
        parsed.append("transformers")
        return read_config(self, *args, **kwargs)

    read_config = SafetensorsFolder.read_config
    monkeypatch.setattr(placement, "folder_format", counted_source)
    monkeypatch.setattr(placement, "read_json_object", counted_json(placement.read_json_object))
    monkeypatch.setattr(formats, "read_json_object", counted_json(formats.read_json_object))
    monkeypatch.setattr(SafetensorsFolder, "read_config", counted_config)
    built, _, note, residency = place_on(out, "cpu", None, prompt_tokens=5, new_tokens=8)
    assert residency.form != "dense" and "compressed" in note  # the compressed build, which every layer reads
    assert len(chosen) == 1, chosen
    assert sorted(parsed) == ["json", "transformers"], parsed
    assert torch.equal(_logits(built), _logits(model))
