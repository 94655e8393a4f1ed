"""What a throughput row records it ran under (benchmarks/_gpu_state.py): the GPU's clocks, power and temperature
from NVML, None with a reason where there is no GPU, and the attention kernel named from the profiled ops."""

import types

import pytest

from benchmarks import _gpu_state
from benchmarks._gpu_state import FIELDS, attention_kernel, gpu_state


def fake_nvml(reasons=0x4, fail=()):
    """A stand-in for ``pynvml`` with an H100's figures (power in mW, as NVML reports it)."""
    values = {"nvmlDeviceGetClockInfo": {1: 1755, 2: 2619}, "nvmlDeviceGetMaxClockInfo": {1: 1980, 2: 2619},
              "nvmlDeviceGetPowerUsage": 512_345, "nvmlDeviceGetEnforcedPowerLimit": 700_000,
              "nvmlDeviceGetTemperature": 61, "nvmlDeviceGetPerformanceState": 0,
              "nvmlDeviceGetCurrentClocksEventReasons": reasons}
    nvml = types.SimpleNamespace(NVML_CLOCK_SM=1, NVML_CLOCK_MEM=2, NVML_TEMPERATURE_GPU=0, nvmlInit=lambda: None,
                                 nvmlDeviceGetHandleByIndex=lambda i: f"gpu{i}")
    for name, value in values.items():
        def call(handle, *args, _name=name, _value=value):
            if _name in fail:
                raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
            return _value[args[0]] if isinstance(_value, dict) else _value
        setattr(nvml, name, call)
    return nvml


def test_one_sample_has_clocks_power_temperature_and_the_limits_in_force():
    state = gpu_state(0, nvml=fake_nvml(reasons=0x4 | 0x20))
    assert state == {"sm_clock_mhz": 1755, "mem_clock_mhz": 2619, "max_sm_clock_mhz": 1980, "max_mem_clock_mhz": 2619,
                     "power_w": 512.3, "power_limit_w": 700.0, "temperature_c": 61, "pstate": 0,
                     "clock_limits": ["sw_power_cap", "sw_thermal_slowdown"]}


def test_a_field_the_driver_does_not_report_is_none_and_the_older_reason_call_is_used():
    nvml = fake_nvml(fail=("nvmlDeviceGetPowerUsage", "nvmlDeviceGetCurrentClocksEventReasons"))
    nvml.nvmlDeviceGetCurrentClocksThrottleReasons = lambda handle: 0x1
    state = gpu_state(0, nvml=nvml)
    assert state["power_w"] is None and state["sm_clock_mhz"] == 1755 and state["clock_limits"] == ["gpu_idle"]


def test_without_a_gpu_every_field_is_none_with_the_reason(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    state = gpu_state()
    assert all(state[k] is None for k in FIELDS) and state["unavailable"] == "no CUDA device"
    broken = types.SimpleNamespace(nvmlInit=lambda: (_ for _ in ()).throw(OSError("libnvidia-ml.so.1 not found")))
    state = gpu_state(0, nvml=broken)
    assert all(state[k] is None for k in FIELDS) and "libnvidia-ml" in state["unavailable"]


def test_around_samples_both_sides_of_the_timed_region(monkeypatch):
    calls = []
    monkeypatch.setattr(_gpu_state, "gpu_state", lambda index=0: calls.append(index) or {"sm_clock_mhz": len(calls)})
    result, state = _gpu_state.around(lambda: "timed")
    assert result == "timed" and state == {"before": {"sm_clock_mhz": 1}, "after": {"sm_clock_mhz": 2}}


@pytest.mark.parametrize("ops, kernel", [
    ({"aten::scaled_dot_product_attention": 32, "aten::_scaled_dot_product_cudnn_attention": 32,
      "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3": 32}, "sdpa:cudnn"),
    ({"aten::_scaled_dot_product_flash_attention": 32, "void pytorch_flash::flash_fwd_splitkv_kernel<...>": 32},
     "sdpa:flash"),
    ({"aten::_scaled_dot_product_efficient_attention": 32, "fmha_cutlassF_bf16_aligned_64x64_rf_sm80": 32},
     "sdpa:efficient"),
    ({"aten::scaled_dot_product_attention": 4, "aten::_scaled_dot_product_attention_math": 4}, "sdpa:math"),
    ({"aten::scaled_dot_product_attention": 4}, "sdpa:math"),
    ({"aten::_scaled_dot_product_flash_attention_for_cpu": 4}, "sdpa:cpu_flash"),
    ({"_segment_kernel": 64, "_combine_kernel": 16, "aten::_scaled_dot_product_cudnn_attention": 16},
     "triton:minicache+sdpa:cudnn"),
    ({"gather_chunks": 32, "aten::_scaled_dot_product_flash_attention": 32}, "sdpa:flash+triton:shadowkv_gather"),
    ({"_shadowkv_fused_decode_kernel": 32, "gather_chunks": 32}, "triton:shadowkv_gather+triton:shadowkv_fused_decode"),
    ({"some_attention_op": 1}, "other"),
    ({}, None),
])
def test_the_attention_kernel_is_named_from_the_profiled_ops(ops, kernel):
    assert attention_kernel(ops) == kernel
