"""``model.dtype: auto`` on a CPU: bf16 only with native bf16 units, else fp32 over bf16 storage."""

from __future__ import annotations

import logging

import pytest
import torch

from neutrain.compat import cpu_features
from neutrain.trainer import modeling
from tests.helpers import write_recipe

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu sse2 avx avx2 fma\n"
AVX512_BF16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"


@pytest.fixture
def fake_cpu(monkeypatch, tmp_path):
    """Point the detector at a fake /proc/cpuinfo (and no GPU) for the test's duration."""
    def use(text):
        path = tmp_path / "cpuinfo"
        path.write_text(text)
        cpu_features.native_bf16_feature.cache_clear()
        monkeypatch.setattr(cpu_features, "CPUINFO", str(path))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    yield use
    cpu_features.native_bf16_feature.cache_clear()


@pytest.mark.parametrize(("cpuinfo", "feature"), [(AVX2_ONLY, None), (AVX512_BF16, "avx512_bf16"),
                                                  (SAPPHIRE_RAPIDS, "amx_bf16")], ids=["avx2", "avx512_bf16", "amx_bf16"])
def test_the_detector_reads_the_cpus_bf16_units(tmp_path, cpuinfo, feature):
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    assert cpu_features.native_bf16_feature(str(path)) == feature


def test_without_proc_cpuinfo_torch_answers(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_features, "_torch_flags", lambda: {"avx512_bf16"})
    assert cpu_features.native_bf16_feature(str(tmp_path / "missing")) == "avx512_bf16"
    monkeypatch.setattr(cpu_features, "_torch_flags", set)
    assert cpu_features.native_bf16_feature(str(tmp_path / "missing-too")) is None


def test_auto_computes_in_fp32_on_a_cpu_without_bf16_units(tmp_path, fake_cpu, caplog):
    from neutrain.config import load_recipe
    from neutrain.data import byte_tokenizer
    from neutrain.nn import CompressedLinear

    fake_cpu(AVX2_ONLY)
    assert modeling.resolve_dtype("auto", use_cpu=True) == torch.float32
    recipe = load_recipe(write_recipe(tmp_path, model={"dtype": "auto"}))
    with caplog.at_level(logging.INFO, logger="neutrain.trainer.modeling"):
        model = modeling.build_model(recipe.model, byte_tokenizer(), use_cpu=True, weights="neuzip-lossless")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("model.dtype auto")]
    assert lines == ["model.dtype auto: float32 on this CPU (no AMX or AVX512-BF16: bf16 products would be "
                     "emulated); NeuZip weights stay bf16 and are upcast exactly"]
    layer = next(m for m in model.modules() if isinstance(m, CompressedLinear))
    assert (layer.compressed.ct.dtype, layer.compressed.compute_dtype) == (torch.bfloat16, torch.float32)
    # fp32 compute decodes the bf16 bit patterns and upcasts them: exactly the stored values.
    stored = layer.compressed.decode()
    assert torch.equal(layer.compressed.decode_for_compute(), stored.float())


@pytest.mark.parametrize("cpuinfo", [AVX512_BF16, SAPPHIRE_RAPIDS], ids=["avx512_bf16", "amx_bf16"])
def test_auto_computes_in_bf16_on_a_cpu_with_bf16_units(tmp_path, fake_cpu, caplog, cpuinfo):
    from neutrain.config import load_recipe
    from neutrain.data import byte_tokenizer
    from neutrain.nn import CompressedLinear

    fake_cpu(cpuinfo)
    assert modeling.resolve_dtype("auto", use_cpu=True) == torch.bfloat16
    recipe = load_recipe(write_recipe(tmp_path, model={"dtype": "auto"}))
    with caplog.at_level(logging.INFO, logger="neutrain.trainer.modeling"):
        model = modeling.build_model(recipe.model, byte_tokenizer(), use_cpu=True, weights="neuzip-lossless")
    feature = "amx_bf16" if cpuinfo is SAPPHIRE_RAPIDS else "avx512_bf16"
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("model.dtype auto")] == [
        f"model.dtype auto: bfloat16 on this CPU (it has {feature}: native bf16 products)"]
    layer = next(m for m in model.modules() if isinstance(m, CompressedLinear))
    assert (layer.compressed.ct.dtype, layer.compressed.compute_dtype) == (torch.bfloat16, torch.bfloat16)
    # The export keeps bf16 either way.
    assert modeling.export_dtype(recipe.model, "neuzip-lossless", use_cpu=True) == "bfloat16"


def test_explicit_dtypes_ignore_the_cpu(fake_cpu):
    fake_cpu(SAPPHIRE_RAPIDS)
    assert modeling.resolve_dtype("float32", use_cpu=True) == torch.float32
    fake_cpu(AVX2_ONLY)
    assert modeling.resolve_dtype("bfloat16", use_cpu=True) == torch.bfloat16


@pytest.mark.parametrize(("cpuinfo", "bits"), [(AVX2_ONLY, 32), (AVX512_BF16, 16)], ids=["avx2", "avx512_bf16"])
def test_the_size_check_counts_auto_as_the_dtype_this_cpu_builds(fake_cpu, cpuinfo, bits):
    """``check_model_size`` refuses by the bytes the build will take: fp32 only where auto resolves to fp32."""
    from neutrain.cli.preflight import check_model_size
    from neutrain.config import load_recipe
    from neutrain.errors import RecipeError
    from neutrain.trainer.modeling import config_only
    from neutrain.memory import ModelShape

    fake_cpu(cpuinfo)
    recipe = load_recipe("default", ["model.dtype=auto", "memory.weights=dense", "train.use_cpu=true"])
    need = ModelShape.from_config(config_only(recipe.model)).params() * bits // 8
    check_model_size(recipe, host_bytes=need, device_bytes=None)  # exactly enough: accepted
    with pytest.raises(RecipeError, match="GiB of host memory"):
        check_model_size(recipe, host_bytes=need - 1, device_bytes=None)
