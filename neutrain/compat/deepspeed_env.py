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
from collections.abc import MutableMapping


def name_cpu_accelerator(environ: MutableMapping[str, str] = os.environ, cuda_available: bool | None = None) -> None:
    """Set ``DS_ACCELERATOR=cpu`` when there is no GPU and the variable is unset (before DeepSpeed is imported)."""
    if "DS_ACCELERATOR" in environ:
        return
    if cuda_available is None:
        import torch  # lazy: only when the caller does not know

        cuda_available = torch.cuda.is_available()
    if not cuda_available:
        environ["DS_ACCELERATOR"] = "cpu"
