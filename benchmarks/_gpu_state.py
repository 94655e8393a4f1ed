"""What a throughput figure ran under: the GPU's clocks, power and temperature (NVML), and the attention kernel.

The full cache's decode at 64K on Llama-3-8B shapes ran 132, 78 and 64 tokens/s in three H100 runs of the
same code at the same batch (``benchmarks/kv/NOTES.md``). A figure is only comparable with another when
both say which attention kernel ran and at what clocks, so every throughput row records them:

* :func:`gpu_state`: one NVML sample (SM and memory clocks and their maxima, power draw and limit,
  temperature, performance state, the reasons the clocks are held down); every field None, with the reason,
  where there is no NVIDIA GPU or no NVML binding (``nvidia-ml-py``, in the GPU image);
* :func:`attention_kernel`: the attention kernels a profiled decode step ran (``attention_ops`` of
  ``benchmarks/kv/_kv_timing.py``), named by backend: cuDNN, flash, memory-efficient or math SDPA, or
  neutrain's own Triton kernels.

Example (on a machine without a GPU):
    >>> gpu_state()["sm_clock_mhz"] is None
    True
    >>> attention_kernel({"aten::_scaled_dot_product_cudnn_attention": 32, "cudnn_generated_fort_native_sdpa": 32})
    'sdpa:cudnn'
"""

from __future__ import annotations

FIELDS = ("sm_clock_mhz", "mem_clock_mhz", "max_sm_clock_mhz", "max_mem_clock_mhz", "power_w", "power_limit_w",
          "temperature_c", "pstate", "clock_limits")

# NVML's clocks event (throttle) reason bits (nvml.h, nvmlClocksEventReason*), by what they mean here.
CLOCK_LIMITS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
                0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting"}


def _nvml_handle(nvml, device_index: int):
    """NVML's handle of CUDA device ``device_index`` (by PCI bus id where torch gives one: NVML and CUDA may
    number the GPUs differently)."""
    try:
        import torch

        bus = getattr(torch.cuda.get_device_properties(device_index), "pci_bus_id", None)
        if bus is not None:
            domain = getattr(torch.cuda.get_device_properties(device_index), "pci_domain_id", 0)
            dev = getattr(torch.cuda.get_device_properties(device_index), "pci_device_id", 0)
            return nvml.nvmlDeviceGetHandleByPciBusId(f"{domain:08x}:{bus:02x}:{dev:02x}.0")
    except Exception:  # noqa: BLE001 - fall back to NVML's own numbering
        pass
    return nvml.nvmlDeviceGetHandleByIndex(device_index)


def gpu_state(device_index: int = 0, nvml=None) -> dict:
    """One NVML sample of CUDA device ``device_index``: :data:`FIELDS` (clocks in MHz, power in W, temperature
    in degrees C, ``clock_limits`` the names of the reasons the clocks are held down now). Never raises: where
    NVML is missing or has no GPU every field is None and ``unavailable`` says why; a field the driver does not
    report is None. ``nvml``: the ``pynvml`` module (tests pass a stand-in)."""
    out = dict.fromkeys(FIELDS)
    try:
        if nvml is None:
            import torch

            if not torch.cuda.is_available():
                return {**out, "unavailable": "no CUDA device"}
            import pynvml as nvml
        nvml.nvmlInit()
        handle = _nvml_handle(nvml, device_index)
    except Exception as exc:  # noqa: BLE001 - a record, not a failure
        return {**out, "unavailable": f"{type(exc).__name__}: {exc}"[:200]}

    def read(fn, *args, scale=1.0):
        try:
            value = getattr(nvml, fn)(handle, *args)
        except Exception:  # noqa: BLE001 - this driver does not report it
            return None
        return round(value * scale, 1) if scale != 1.0 else value

    sm, mem = getattr(nvml, "NVML_CLOCK_SM", 1), getattr(nvml, "NVML_CLOCK_MEM", 2)
    out.update(sm_clock_mhz=read("nvmlDeviceGetClockInfo", sm), mem_clock_mhz=read("nvmlDeviceGetClockInfo", mem),
               max_sm_clock_mhz=read("nvmlDeviceGetMaxClockInfo", sm),
               max_mem_clock_mhz=read("nvmlDeviceGetMaxClockInfo", mem),
               power_w=read("nvmlDeviceGetPowerUsage", scale=1e-3),
               power_limit_w=read("nvmlDeviceGetEnforcedPowerLimit", scale=1e-3),
               temperature_c=read("nvmlDeviceGetTemperature", getattr(nvml, "NVML_TEMPERATURE_GPU", 0)),
               pstate=read("nvmlDeviceGetPerformanceState"))
    reasons = read("nvmlDeviceGetCurrentClocksEventReasons")
    if reasons is None:
        reasons = read("nvmlDeviceGetCurrentClocksThrottleReasons")  # the older name of the same call
    if reasons is not None:
        out["clock_limits"] = [name for bit, name in CLOCK_LIMITS.items() if reasons & bit]
    return out


def around(fn, device_index: int = 0):
    """``(fn(), {"before": gpu_state(), "after": gpu_state()})``: the GPU's state on either side of a timed
    region (two samples, no sampling thread: a thread beside a launch-bound decode loop would slow it)."""
    before = gpu_state(device_index)
    result = fn()
    return result, {"before": before, "after": gpu_state(device_index)}


# Profiler op and kernel names (lower case) -> the backend they belong to, most specific first.
_BACKENDS = (
    ("_segment_kernel", "triton:minicache"), ("_combine_kernel", "triton:minicache"),
    ("cudnn", "sdpa:cudnn"), ("flash_attention_for_cpu", "sdpa:cpu_flash"), ("flash", "sdpa:flash"),
    ("efficient_attention", "sdpa:efficient"), ("fmha", "sdpa:efficient"), ("_math", "sdpa:math"),
    ("gather_chunks", "triton:shadowkv_gather"), ("_shadowkv_fused_decode_kernel", "triton:shadowkv_fused_decode"),
)


def attention_kernel(ops: dict[str, int] | None) -> str | None:
    """The attention kernels of one profiled decode step, as ``+``-joined backend names in a fixed order
    (``"sdpa:cudnn"``, ``"triton:minicache+sdpa:flash"``...); ``"sdpa:math"`` when SDPA ran without a fused
    backend; None for no record. Unrecognised attention ops are named ``other``."""
    if not ops:
        return None
    found = []
    sdpa_seen = False
    for name in ops:
        low = name.lower()
        if "scaled_dot_product" in low:
            sdpa_seen = True
        for needle, backend in _BACKENDS:
            if needle in low:
                if backend not in found:
                    found.append(backend)
                break
    if sdpa_seen and not any(b.startswith("sdpa:") for b in found):
        found.append("sdpa:math")  # SDPA decomposed into matmul/softmax: no fused kernel ran
    if not found:
        return "other"
    order = [backend for _, backend in _BACKENDS]
    return "+".join(sorted(found, key=order.index))
