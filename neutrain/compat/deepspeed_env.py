"""DeepSpeed's accelerator detection, told the answer on a machine without a GPU.

Why: importing DeepSpeed (transformers does when it is installed) auto-detects the
accelerator and, finding no GPU, prints a WARNING on every CPU run ("Setting accelerator
to CPU. If you have GPU ... we were unable to detect it."), which a user cannot act on.
Naming the CPU accelerator through DeepSpeed's own ``DS_ACCELERATOR`` variable selects
the same CPU accelerator without the warning. A user's own setting is left alone.

Example:
    >>> import os
    >>> from neutrain.compat.deepspeed_env import name_cpu_accelerator
    >>> env = {}
    >>> name_cpu_accelerator(env, cuda_available=False)
    >>> env
    {'DS_ACCELERATOR': 'cpu'}
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping


GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")
"""What a Linux host with a CUDA (NVIDIA), ROCm (AMD) or WSL GPU has; without any of them torch finds no GPU."""


def no_gpu_device_nodes(platform: str = sys.platform, exists=os.path.exists) -> bool:
    """True when this host certainly has no GPU torch could use, known without importing torch.

    Why: importing torch takes a second or more, and the command line asks this before it reads the
    recipe; a recipe error must come back at once. Where it is not certain (a driver is installed, or
    another system), the answer is False and the caller asks torch.

    Example:
        >>> no_gpu_device_nodes("linux", exists=lambda path: False)
        True
        >>> no_gpu_device_nodes("linux", exists=lambda path: path == "/dev/nvidiactl")
        False
    """
    if platform == "darwin":  # torch has no CUDA on macOS
        return True
    return platform.startswith("linux") and not any(exists(path) for path in GPU_DEVICE_NODES)


def name_cpu_accelerator(environ: MutableMapping[str, str] = os.environ, cuda_available: bool | None = None) -> None:
    """Set ``DS_ACCELERATOR=cpu`` when there is no GPU and the variable is unset (before DeepSpeed is imported)."""
    if "DS_ACCELERATOR" in environ:
        return
    if cuda_available is None and no_gpu_device_nodes():
        cuda_available = False
    if cuda_available is None:
        import torch  # lazy: only when the caller does not know and the device files do not tell

        cuda_available = torch.cuda.is_available()
    if not cuda_available:
        environ["DS_ACCELERATOR"] = "cpu"
