"""``Launcher``: the first launch of a specialization through Triton, later ones through the compiled launcher.

On CPU a recording stand-in plays the jitted kernel and its ``CompiledKernel``, so these tests
check what reaches the launcher (argument order, constexprs, the stream) and when the cache
must not be used; the real launch is tested on a GPU in tests/kernels/test_codec.py.
"""

import pytest
import torch

launch = pytest.importorskip("neutrain.kernels.launch")


class _Compiled:
    function, packed_metadata = "function-handle", "packed"

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


class _Kernel:
    """A jitted kernel ``(x_ptr, n, BLOCK: constexpr, EVEN: constexpr)`` that records its dispatches."""

    arg_names = ["x_ptr", "n", "BLOCK", "EVEN"]

    def __init__(self):
        self.dispatches = []
        self.compiled = []

    def __getitem__(self, grid):
        def dispatch(*args, **kwargs):
            self.dispatches.append((grid, args, kwargs))
            self.compiled.append(_Compiled())
            return self.compiled[-1]
        return dispatch


@pytest.fixture
def compiled_mode(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the stand-in is "compiled"; Triton itself is never called
    kernel = _Kernel()
    return kernel, launch.Launcher(kernel, current=lambda: (0, "stream-0"))


def test_second_launch_goes_through_the_compiled_launcher_with_every_argument_in_order(compiled_mode):
    kernel, launcher = compiled_mode
    x = torch.zeros(64, dtype=torch.int16)
    meta = {"EVEN": True, "BLOCK": 128}  # not in signature order: the launcher must reorder them
    first = launcher((3,), (x, 100), meta, num_warps=4)
    assert kernel.dispatches == [((3,), (x, 100), {"EVEN": True, "BLOCK": 128, "num_warps": 4})]
    assert launcher((5,), (x, 100), meta, num_warps=4) is first
    assert len(kernel.dispatches) == 1 and launcher.fast_launches == 1
    assert first.calls == [(5, 1, 1, "stream-0", "function-handle", "packed", None, None, None, x, 100, 128, True)]


@pytest.mark.parametrize("change", ["unaligned pointer", "dtype", "n == 1", "n % 16", "n past int32",
                                    "constexpr", "num_warps", "device"])
def test_a_launch_triton_would_specialize_differently_goes_through_triton(compiled_mode, change):
    kernel, launcher = compiled_mode
    x = torch.zeros(64, dtype=torch.int16)
    args, meta, options = (x, 96), {"BLOCK": 128, "EVEN": True}, {"num_warps": 4}
    launcher((1,), args, meta, **options)
    if change == "unaligned pointer":
        args = (x[1:], 96)
    elif change == "dtype":
        args = (x.view(torch.uint16), 96)
    elif change == "n == 1":
        args = (x, 1)
    elif change == "n % 16":
        args = (x, 97)
    elif change == "n past int32":
        args = (x, 96 * 2**32)
    elif change == "constexpr":
        meta = {"BLOCK": 256, "EVEN": True}
    elif change == "num_warps":
        options = {"num_warps": 8}
    else:
        launcher._current = lambda: (1, "stream-1")
    launcher((1,), args, meta, **options)
    assert len(kernel.dispatches) == 2 and launcher.fast_launches == 0
    launcher((1,), args, meta, **options)  # now this specialization is known too
    assert len(kernel.dispatches) == 2 and launcher.fast_launches == 1


def test_interpreter_and_launch_hooks_always_take_tritons_dispatch(compiled_mode, monkeypatch):
    from triton import knobs

    kernel, launcher = compiled_mode
    x = torch.zeros(64, dtype=torch.int16)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)  # Triton 3.6's form of a hook
    for _ in range(2):
        launcher((1,), (x, 96), {"BLOCK": 128, "EVEN": True})
    chain = type("HookChain", (), {"calls": [print]})()  # later Tritons' form, with a hook in it
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", chain)
    launcher((1,), (x, 96), {"BLOCK": 128, "EVEN": True})
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for _ in range(2):
        launcher((1,), (x, 96), {"BLOCK": 128, "EVEN": True})
    assert len(kernel.dispatches) == 5 and launcher.fast_launches == 0


def test_a_kernel_whose_constexprs_are_not_all_given_is_never_cached(compiled_mode):
    kernel, launcher = compiled_mode
    x = torch.zeros(64, dtype=torch.int16)
    for _ in range(2):
        launcher((1,), (x, 96), {"BLOCK": 128})  # EVEN left to its default: Triton binds it
    assert len(kernel.dispatches) == 2 and launcher.fast_launches == 0
