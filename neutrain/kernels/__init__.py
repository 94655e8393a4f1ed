"""Triton kernels. Each op lives in one file with its launcher; its pure-PyTorch
reference lives in the library layer that uses it (``neutrain.compress``,
``neutrain.attention``, ...).

The Triton modules are imported lazily by those layers (marked ``# lazy:``), never by
``import neutrain``, so that importing transformers or neutrain's Trainer never compiles a
kernel. This ``__init__`` and :mod:`neutrain.kernels.sage_format` (the data format the
sage kernels share with their torch reference) import no Triton and may be imported anywhere.
"""

import os


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter (``TRITON_INTERPRET=1``).

    Kernels use a single autotune config when interpreting: the interpreter cannot
    benchmark configurations, and tests use tiny shapes anyway.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_available() -> bool:
    """True when Triton can be imported (Linux wheels only)."""
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on platform
        return False
    return True
