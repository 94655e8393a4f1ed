"""Accelerate's model preparation without the DDP wrap, behind one named adapter.

Why: Accelerate wraps every trainable model in DDP on a multi-process run; DDP's
reducer would then all-reduce gradients a second time, in full-size buckets,
while neutrain's fused updates already average each gradient inside backward.
``prepare_model(evaluation_mode=True)`` is Accelerate's own way to skip the wrap
(device placement and autocast still apply); :func:`skip_ddp_wrapping` pins it
for the accelerator's lifetime by replacing that one bound method.

Example:
    >>> from accelerate import Accelerator
    >>> from neutrain.compat.accelerate_prepare import skip_ddp_wrapping
    >>> accelerator = Accelerator(cpu=True)
    >>> skip_ddp_wrapping(accelerator)
    >>> accelerator.prepare_model.func.__name__
    '_prepare_model_unwrapped'
"""

from __future__ import annotations

import functools


def skip_ddp_wrapping(accelerator) -> None:
    """Make ``accelerator.prepare`` leave models unwrapped (no DDP) on this accelerator; idempotent."""
    if getattr(accelerator, "_neutrain_no_ddp", False):
        return
    accelerator.prepare_model = functools.partial(_prepare_model_unwrapped, accelerator.prepare_model)
    accelerator._neutrain_no_ddp = True


def _prepare_model_unwrapped(prepare_model, model, device_placement=None, evaluation_mode=False):
    return prepare_model(model, device_placement=device_placement, evaluation_mode=True)
