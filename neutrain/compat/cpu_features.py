"""Whether this CPU computes bf16 natively: the one fact ``model.dtype: auto`` needs on a CPU.

Why: without bf16 units a bf16 matrix product is emulated (measured: 4.9 GFLOP/s against 29.5 for
fp32 on an AVX2 CPU), with them it is several times faster than fp32 (103 against 23 GFLOP/s for a
1024^3 product on the AVX512-BF16 CPU this was written on). Linux lists the features in
``/proc/cpuinfo``; elsewhere torch's CPU capability probe answers (``torch.cpu.get_capabilities``
from torch 2.13, the older private ``torch.cpu._is_*_supported`` helpers before it).

Example:
    >>> native_bf16_feature() in (None, "amx_bf16", "avx512_bf16")
    True
"""

from __future__ import annotations

import functools

# What oneDNN computes bf16 products with, fastest first.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpuinfo_flags(text: str) -> set[str]:
    """The feature flags a ``/proc/cpuinfo`` text lists (x86 ``flags``, Arm ``Features``).

    Example:
        >>> sorted(cpuinfo_flags("processor : 0\\nflags : fpu avx2 avx512_bf16\\n"))
        ['avx2', 'avx512_bf16', 'fpu']
    """
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return flags


def _torch_flags() -> set[str]:
    import torch

    get = getattr(torch.cpu, "get_capabilities", None)
    if get is not None:
        caps = dict(get())
        return {name for name in NATIVE_BF16_FLAGS if caps.get(name)}
    flags = set()
    if getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        flags.add("avx512_bf16")
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():  # AMX tiles come with AMX-BF16
        flags.add("amx_bf16")
    return flags


CPUINFO = "/proc/cpuinfo"


@functools.lru_cache(maxsize=None)
def native_bf16_feature(cpuinfo: str | None = None) -> str | None:
    """``"amx_bf16"`` or ``"avx512_bf16"`` where this CPU has it, else None (``cpuinfo``: default :data:`CPUINFO`)."""
    try:
        with open(cpuinfo or CPUINFO) as f:
            flags = cpuinfo_flags(f.read())
    except OSError:
        flags = set()
    if not flags:  # no /proc (macOS, Windows) or a kernel that lists none
        flags = _torch_flags()
    return next((name for name in NATIVE_BF16_FLAGS if name in flags), None)
