"""Reproducible GPU kernels for a training run (``train.deterministic``): the same bits on every run.

Why it is needed: PyTorch's fused attention backward kernels (SDPA's flash, memory-efficient and
cuDNN paths) add partial gradients in whatever order the GPU's blocks finish, so two runs of the
same recipe from the same weights and data drift apart by rounding from the first step on, and a
run resumed from a checkpoint cannot end bit for bit as the uninterrupted run did. Measured on an
H100/H200 with Llama-3-8B shapes at 1,024 tokens: two uninterrupted 4-step runs of the same compressed
model differed in every trained tensor (weights offloaded, or sequences packed); with
``torch.use_deterministic_algorithms(True)`` (or the math attention) both runs and a resume from step 2
were bit-identical, offload and packing included. Nothing else in a neutrain step varies: the codec,
the fused updates and the weight and activation offload are deterministic by construction.

What it costs (H200, four Llama-3-8B decoder layers, forward and backward): 1.19x at 1 x 1,024 tokens,
1.06x at 8 x 1,024, 1.40x at 1 x 16K; with packed sequences 1.32x, 1.12x and 4.27x. So it is a
switch, off by default; CPU training is deterministic either way.

cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG`` set for PyTorch to accept deterministic mode; it is set here
when the user has not, and both are put back when training ends, so evaluation and generation after
it run as before.

Example:
    >>> with deterministic_kernels(True):
    ...     torch.are_deterministic_algorithms_enabled()
    True
    >>> torch.are_deterministic_algorithms_enabled()
    False
"""

from __future__ import annotations

import contextlib
import os

import torch

CUBLAS_WORKSPACE = ("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
"""cuBLAS's reproducible workspace setting (PyTorch refuses deterministic mode on CUDA without it)."""
FLASH_ATTENTION_DETERMINISTIC = ("FLASH_ATTENTION_DETERMINISTIC", "1")
"""What transformers' ``flash_attention_2`` path reads to ask the flash-attn package for its deterministic backward."""


@contextlib.contextmanager
def deterministic_kernels(enabled: bool):
    """Inside: PyTorch picks deterministic kernels (an error names any op that has none); no-op when not ``enabled``.

    The previous setting and environment are restored on exit, exceptions included.
    """
    if not enabled:
        yield
        return
    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    added = [(name, value) for name, value in (CUBLAS_WORKSPACE, FLASH_ATTENTION_DETERMINISTIC) if name not in os.environ]
    os.environ.update(added)  # a user's own setting of either is kept
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
        for name, _ in added:
            os.environ.pop(name, None)
