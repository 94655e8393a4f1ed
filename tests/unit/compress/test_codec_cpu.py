"""The compiled CPU codec writes and reads the reference's bytes, bit for bit, and really runs.

Each case encodes with ``backend="auto"`` (the compiled kernels on CPU when numba is there)
and with ``backend="reference"`` (the PyTorch specification), then compares every stored
buffer and the decoded values. Without numba the module is skipped; the PyTorch fallback
is checked by the last test either way.
"""

import pytest
import torch

from neutrain.compress import codec, codec_cpu, compress
from neutrain.compress.layout import split, to_bits

pytestmark = pytest.mark.skipif(not codec_cpu.available(), reason="numba (neutrain[cpu]) is not installed")

_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
MODES = [None, 0, 1, 3]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT_VIEW[t.dtype])


def _assert_same_bytes(fast, ref):
    assert fast.stream_words == ref.stream_words
    assert torch.equal(fast.stream[: fast.stream_words], ref.stream[: ref.stream_words])
    assert torch.equal(fast.lane_words, ref.lane_words) and torch.equal(fast.tile_base, ref.tile_base)
    assert torch.equal(fast._tails_view(), ref._tails_view())


def _all_patterns(dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Every 16-bit pattern (fp32: every high half with random low halves), shuffled."""
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32)
    patterns = patterns[torch.randperm(patterns.numel(), generator=g)]
    if dtype == torch.float32:
        return ((patterns << 16) | torch.randint(0, 1 << 16, patterns.shape, generator=g, dtype=torch.int32)).view(dtype)
    return patterns.to(torch.int16).view(dtype)


def _check(x: torch.Tensor, kept, **geometry):
    fast, ref = compress(x, kept, **geometry), compress(x, kept, backend="reference", **geometry)
    _assert_same_bytes(fast, ref)
    assert torch.equal(_bits(fast.decompress()), _bits(ref.decompress(backend="reference")))
    return fast, ref


@pytest.mark.slow
@pytest.mark.parametrize("kept", MODES)
def test_all_65536_bf16_patterns_equal_the_reference(kept):
    x = _all_patterns(torch.bfloat16, torch.Generator().manual_seed(1))  # NaN payloads, ±Inf, ±0, subnormals
    fast, _ = _check(x, kept)
    if kept is None:
        assert torch.equal(_bits(fast.decompress()), _bits(x))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("kept", [None, 0, 3, 7])
def test_other_dtypes_equal_the_reference(dtype, kept):
    _check(_all_patterns(dtype, torch.Generator().manual_seed(2)), kept)


@pytest.mark.parametrize("seed", range(4))
def test_fresh_random_inputs_and_geometries_equal_the_reference(seed):
    g = torch.Generator().manual_seed(1000 + seed)
    for kept in MODES:
        for geometry in ({}, {"steps": 3, "lanes": 16, "elems": 2}, {"steps": 5, "lanes": 32, "elems": 1}):
            if kept is not None:
                geometry = {**geometry, "elems": 1}
            numel = int(torch.randint(1, 30_000, (1,), generator=g))
            x = (torch.randn(numel, generator=g) * torch.rand(1, generator=g).item() * 4).bfloat16()
            _check(x, kept, **geometry)


@pytest.mark.parametrize("kept", MODES)
def test_recompress_and_rows_equal_the_reference(kept):
    """The fused optimizer's path: the same tensor re-encoded every step, drift forcing a code rebuild."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(300, 70, generator=g) * 0.02).bfloat16()
    fast, ref = _check(x, kept)
    # Exponents absent when the code was built (and NaN: symbol 256 in lossy modes) are escaped literals.
    rare = x.clone()
    rare[0, :4] = torch.tensor([float("nan"), 1e30, 1e-30, -3e20])
    new_symbols = split(to_bits(rare[0, :4]), fast.layout)[0]
    assert (fast.code_lengths[new_symbols.numpy()] == 0).all()
    fast.recompress_(rare)
    ref.recompress_(rare, backend="reference")
    assert fast.rebuilds == ref.rebuilds == 0
    _assert_same_bytes(fast, ref)
    assert torch.equal(_bits(fast.decompress()), _bits(ref.decompress(backend="reference")))
    for step in range(4):  # small updates, then a large drift that rebuilds the code
        scale = 1e-3 if step < 3 else 50.0
        x = (x.float() + scale * torch.randn(x.shape, generator=g) * 0.02).bfloat16()
        fast.recompress_(x)
        ref.recompress_(x, backend="reference")
        _assert_same_bytes(fast, ref)
        assert fast.rebuilds == ref.rebuilds
        out = torch.empty_like(x)
        assert fast.decompress(out=out) is out
        assert torch.equal(_bits(out), _bits(ref.decompress(backend="reference")))
    assert fast.rebuilds == 1
    rows = torch.tensor([[5, 299], [0, 5]])
    assert torch.equal(_bits(fast.decompress_rows(rows)), _bits(ref.decompress_rows(rows, backend="reference")))


def test_symbol_decoder_equals_the_jumping_decoder_on_tile_subsets():
    x = (torch.randn(40_003) * 0.02).bfloat16()
    ct = compress(x, steps=4, lanes=16)
    args = (ct.stream, ct.lane_words, ct.tile_base, ct.lut, ct.numel, ct.steps, ct.lanes)
    tiles = torch.tensor([ct.tiles - 1, 0, 3, 3, ct.tiles // 2])
    for subset in (None, tiles):
        spec = codec.decode_tiles_jumping(*args, tiles=subset, elems=ct.elems)
        assert torch.equal(codec_cpu.decode_symbols(ct, subset), spec)


def test_the_compiled_path_runs_on_cpu_and_the_fallback_when_disabled(monkeypatch):
    x = (torch.randn(64, 64) * 0.02).bfloat16()
    decodes, encodes, jumping = codec_cpu.fast_decodes, codec_cpu.fast_encodes, codec.jumping_decodes
    ct = compress(x)
    assert torch.equal(_bits(ct.decompress()), _bits(x))
    assert (codec_cpu.fast_encodes, codec_cpu.fast_decodes) == (encodes + 1, decodes + 1)
    assert codec.jumping_decodes == jumping
    monkeypatch.setenv("NEUTRAIN_CPU_CODEC", "torch")  # the PyTorch path, as without numba
    assert not codec_cpu.available()
    slow = compress(x)
    _assert_same_bytes(slow, ct)
    assert torch.equal(_bits(slow.decompress()), _bits(x))
    assert (codec_cpu.fast_encodes, codec_cpu.fast_decodes) == (encodes + 1, decodes + 1)
    assert codec.jumping_decodes == jumping + 1
