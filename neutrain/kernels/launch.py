"""Launching a compiled Triton kernel again without Triton's Python dispatch.

``kernel[grid](*args, **meta)`` binds the arguments, computes their specialization
(pointer alignment, integer sizes), builds a cache key, looks the compiled kernel up,
checks the kernel's global variables and builds launch metadata: tens of microseconds
of Python per launch. For the codec's re-encode, which training calls once per weight
matrix inside backward, that host time exceeded the GPU time of the small matrices
(k/v: ``recompress_(sync=False)`` at 61 GB/s against 120 for its kernels on an H100,
benchmarks/codec/NOTES.md).

:class:`Launcher` takes the first launch of each key through Triton, keeps
the returned ``CompiledKernel`` and calls its launcher (``CompiledKernel.run``, the
same callable ``JITFunction.run`` ends in, with the same arguments) on later launches.
The key is what Triton specializes a compiled kernel on (:func:`arg_key`: each
tensor's dtype and 16-byte alignment, each integer's size class, divisibility by 16
and equality to 1; the constexprs and options; the current device), so a launch that
Triton would compile differently never reuses a kernel. Under the interpreter,
with a launch hook installed (profilers) or on a Triton whose compiled kernels lack
the launcher attributes, every launch goes through Triton's dispatch.
"""

from __future__ import annotations

from typing import Callable

import torch

from neutrain.kernels import interpreting


FAST = True
"""False: every launch through Triton's dispatch (benchmarks/codec/codec_encode_host.py times both)."""


def arg_key(args: tuple) -> tuple:
    """What Triton specializes a kernel on, per positional argument (~2 us for 15 arguments).

    Tensors: dtype and 16-byte alignment of the data pointer. Integers: equal to 1, divisible
    by 16, fits int32 (else int64). Floats: the type. Booleans and None: the value.
    """
    return tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
                 else (a == 1, a % 16 == 0, -(2**31) <= a < 2**31) if type(a) is int
                 else (type(a), a if a is None or type(a) is bool else None)
                 for a in args)


def _active(hook) -> bool:
    # Triton 3.6: a hook is a callable or None; later: a HookChain, empty unless a profiler added to it.
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooked() -> bool:
    try:
        from triton import knobs
    except ImportError:  # pragma: no cover - Triton before 3.4 (pyproject requires 3.4)
        return True
    return _active(knobs.runtime.launch_enter_hook) or _active(knobs.runtime.launch_exit_hook)


def _device_and_stream():
    from triton.runtime import driver

    device = driver.active.get_current_device()
    return device, driver.active.get_current_stream(device)


class Launcher:
    """A jitted kernel launched through its compiled launcher once a key has been seen.

    Args:
        kernel: the ``@triton.jit`` function. Its constexpr parameters must come after
            all the positional arguments callers pass (they are given as ``meta``).
        current: ``() -> (device, stream)`` (default: Triton's active driver); tests inject one.

    Example (on a GPU; ``_copy_kernel`` a jitted kernel with one constexpr ``BLOCK``):
        >>> launch = Launcher(_copy_kernel)                                  # doctest: +SKIP
        >>> launch((blocks,), (x, y, n), {"BLOCK": 1024}, num_warps=4)       # doctest: +SKIP
    """

    def __init__(self, kernel, current: Callable | None = None):
        self.kernel = kernel
        self._current = current or _device_and_stream
        self._compiled: dict = {}
        self.fast_launches = 0  # launches that skipped Triton's dispatch (tests and benchmarks read it)

    def __call__(self, grid: tuple, args: tuple, meta: dict, **options):
        """Launch ``kernel[grid](*args, **meta, **options)``; return the ``CompiledKernel`` (interpreter: None)."""
        if not FAST or interpreting() or _hooked():
            return self.kernel[grid](*args, **meta, **options)
        device, stream = self._current()
        key = (device, arg_key(args), tuple(meta.items()), tuple(options.items()))
        entry = self._compiled.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **meta, **options)
            entry = self._entry(compiled, len(args), meta)
            if entry is not None:
                self._compiled[key] = entry
            return compiled
        compiled, tail = entry
        # Triton's own call (JITFunction.run): every bound argument in signature order, constexprs included;
        # no hook is active, so no launch metadata and no hooks to call.
        compiled.run(*grid, *(1,) * (3 - len(grid)), stream, compiled.function, compiled.packed_metadata, None,
                     None, None, *args, *tail)
        self.fast_launches += 1
        return compiled

    def _entry(self, compiled, positional: int, meta: dict):
        """(compiled kernel, the constexpr values after the positional arguments), or None if unusable."""
        if not all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata")):
            return None
        names = list(getattr(self.kernel, "arg_names", ()))
        rest = names[positional:]
        if not names or set(rest) != set(meta):
            return None  # defaulted or keyword-passed non-constexpr parameters: leave them to Triton
        return compiled, tuple(meta[name] for name in rest)
