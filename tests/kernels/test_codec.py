"""Triton codec kernels against the PyTorch reference, bit for bit.

On CPU these run through Triton's interpreter on tiny tiles (conftest sets
TRITON_INTERPRET=1); the ``gpu`` tests repeat the comparison at full size on a
GPU, check every bf16 pattern, and prove that decode neither synchronises nor
allocates.
"""

import pytest
import torch

from neutrain.compress import compress, stream as kstream
from tests.helpers import assert_same_format as _assert_same_format

kcodec = pytest.importorskip("neutrain.kernels.codec")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sample(shape, device=DEVICE):
    x = torch.randn(*shape, device=device).mul(0.02).bfloat16()
    flat = x.view(-1)
    if flat.numel() >= 6:  # specials: NaN with payload, ±Inf, max finite, subnormal, -0
        flat[:6] = torch.tensor([0x7FC1, 0x7F80, -128, 0x7F7F, 0x0003, -32768], dtype=torch.int16,
                                device=device).view(torch.bfloat16)
    return x


def _check(x, kept, steps, lanes, elems=None):
    before = dict(kcodec.COUNTERS)
    ref = compress(x, kept, steps=steps, lanes=lanes, elems=elems, backend="reference")
    fast = compress(x, kept, steps=steps, lanes=lanes, elems=elems, backend="triton")
    assert fast.elems == (elems or (4 if kept is None else 1))
    assert kcodec.COUNTERS["count"] > before["count"] and kcodec.COUNTERS["pack"] > before["pack"]
    _assert_same_format(ref, fast)
    want = ref.decompress(backend="reference")
    got = fast.decompress(out=torch.empty_like(x), backend="triton")
    assert kcodec.COUNTERS["decode"] > before["decode"]
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    if kept is None:
        assert torch.equal(got.view(torch.int16), x.view(torch.int16))
    return fast


@pytest.mark.parametrize("kept", [None, 0, 1, 3])
@pytest.mark.parametrize("shape", [(37,), (5, 29)])
def test_kernels_match_reference_in_interpreter(kept, shape):
    _check(_sample(shape), kept, steps=4, lanes=16)


@pytest.mark.parametrize("elems", [1, 2])
def test_lossless_kernels_other_elems_in_interpreter(elems):
    _check(_sample((7, 23)), None, steps=4, lanes=16, elems=elems)


def test_kernel_rows_and_recompress_in_interpreter():
    x = _sample((13, 11))
    ct = compress(x, steps=4, lanes=16, backend="triton")
    index = torch.tensor([12, 0, 5], device=x.device)
    rows = ct.decompress_rows(index, backend="triton")
    assert torch.equal(rows.view(torch.int16), x[index].view(torch.int16))
    y = _sample((13, 11)).mul(64)  # drift: new exponents force escapes, then a rebuild
    ct.recompress_(y, backend="triton")
    ref = compress(y, steps=4, lanes=16, backend="reference")
    assert ct.rebuilds == 1
    _assert_same_format(ct, ref)


def _long_code_sample(n, kind, device=DEVICE):
    """bf16 weights whose exponents, under :func:`_long_code`, take 1-, 10-, 11- and 12-bit codes and
    21-bit escapes (``kind="escapes"``: escapes only, so every step of 4 symbols reads 84 bits)."""
    exponents = torch.tensor([5, 200] if kind == "escapes" else [120, 120, 129, 130, 131, 5, 200])
    e = exponents[torch.randint(len(exponents), (n,))]
    bits = (torch.randint(2, (n,)) << 15) | (e << 7) | torch.randint(128, (n,))
    return bits.to(torch.int16).view(torch.bfloat16).to(device)


def _long_code():
    """Code lengths for exponents 120..131 with counts 4^-i: codes of 1..12 bits, a 12-bit escape."""
    import numpy as np

    from neutrain.compress import huffman

    hist = np.zeros(huffman.NUM_SYMBOLS)
    hist[120:132] = 4.0 ** -np.arange(12) * 2.0 ** 40
    lengths = huffman.build_code(hist)
    assert lengths[huffman.ESCAPE] == lengths[131] == 12 and lengths[130] == 11  # the premise of these tests
    return lengths


def _check_long_codes(n, kind, steps, lanes, elems, tiles):
    from neutrain.compress import CompressedTensor
    from neutrain.compress.layout import layout_for

    x = _long_code_sample(n, kind)
    cts = {}
    for backend in ("reference", "triton"):
        ct = CompressedTensor(layout_for(torch.bfloat16), x.shape, x.device, steps, lanes, elems, _long_code())
        ct._encode(x, backend, fresh_code=True)
        cts[backend] = ct
    ref = cts["reference"]
    assert ref.tiles == tiles and ref.rebuilds == 0
    if kind == "escapes":
        assert 32 * ref.lane_words[:lanes].max() >= steps * elems * 21  # every step of the first tile read 21 E bits
    _assert_same_format(cts["triton"], ref)
    for ct in cts.values():
        got = ct.decompress(out=torch.full_like(x, float("nan")), backend="triton")
        assert torch.equal(got.view(torch.int16), x.view(torch.int16))
    # Exactly as a checkpoint holds it: no stream word past the 3 padding words to read (a loaded tensor gets
    # headroom; cut here so that a read past the used words would fall outside the stream).
    loaded = CompressedTensor.from_state_dict(ref.state_dict())
    loaded.stream = loaded.stream[: loaded.stream_words].clone()
    assert torch.equal(loaded.decompress(backend="triton").view(torch.int16), x.view(torch.int16))


@pytest.mark.parametrize("kind", ["escapes", "mixed"])
@pytest.mark.parametrize("n,elems", [(600, 4), (601, 4), (599, 2), (557, 1)])
def test_decode_window_on_long_codes_and_escapes_in_interpreter(kind, n, elems):
    """The decoder's per-step window: steps whose symbols span 3 words (4 escapes are 84 bits), codes
    of every length at every alignment, a last partial tile and a last partial step (``n % elems``)."""
    _check_long_codes(n, kind, 16 // elems, 16, elems, tiles=3)


@pytest.mark.parametrize("offset", [0, 1, 2, 4])
def test_decode_into_out_at_any_alignment_in_interpreter(offset):
    """An 8-byte aligned ``out`` takes one 8-byte store per lane and step; any other (a view into a
    buffer) takes the per-element stores; both write exactly the tensor's elements."""
    x = _sample((40, 16))
    ct = compress(x, steps=4, lanes=16, backend="triton")
    buffer = torch.full((x.numel() + 8,), float("nan"), dtype=torch.bfloat16, device=x.device)
    out = buffer[offset: offset + x.numel()].view(x.shape)
    assert (out.data_ptr() % 8 == 0) == (offset % 4 == 0)
    ct.decompress(out=out, backend="triton")
    assert torch.equal(out.view(torch.int16), x.view(torch.int16))
    untouched = torch.cat([buffer[:offset], buffer[offset + x.numel():]])
    assert torch.isnan(untouched.float()).all()


def test_every_bf16_pattern_through_the_kernels_in_interpreter():
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    x = patterns[torch.randperm(patterns.numel())].view(torch.bfloat16).to(DEVICE)
    ct = compress(x, backend="triton")
    assert ct.steps == 16  # the small-tensor geometry
    _assert_same_format(ct, compress(x, backend="reference"))
    assert torch.equal(ct.decompress(backend="triton").view(torch.int16), x.view(torch.int16))


def test_empty_tensor_through_kernels():
    x = torch.empty(0, 7, dtype=torch.bfloat16, device=DEVICE)
    ct = compress(x, backend="triton")
    assert ct.decompress(backend="triton").shape == (0, 7)


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("kept", [None, 0, 1, 3])
@pytest.mark.parametrize("shape", [(4096, 1024), (1000, 999), (3, 5)])
def test_kernels_match_reference_on_gpu(kept, shape):
    _check(_sample(shape), kept, steps=None, lanes=256)


@pytest.mark.gpu
@pytest.mark.parametrize("elems", [1, 2])
def test_lossless_kernels_other_elems_on_gpu(elems):
    _check(_sample((1000, 999)), None, steps=None, lanes=256, elems=elems)


@pytest.mark.gpu
@pytest.mark.parametrize("kept", [None, 0, 3])
def test_all_bf16_patterns_on_gpu(kept):
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32, device="cuda").to(torch.int16)
    x = patterns[torch.randperm(patterns.numel(), device="cuda")].view(torch.bfloat16)
    _check(x, kept, steps=None, lanes=256)


@pytest.mark.gpu
def test_decode_never_syncs_nor_allocates_on_gpu():
    x = _sample((2048, 4096))
    ct = compress(x)
    out = torch.empty_like(x)
    ct.decompress(out=out)  # compile outside the guarded region
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    before = kcodec.COUNTERS["decode"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            ct.decompress(out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert kcodec.COUNTERS["decode"] == before + 3
    assert torch.cuda.memory_allocated() == allocated
    assert torch.equal(out.view(torch.int16), x.view(torch.int16))


@pytest.mark.gpu
def test_gpu_recompress_rows_and_moves():
    x = _sample((8192, 1024))
    ct = compress(x, name="embed")
    y = (x.float() + 1e-3 * torch.randn_like(x.float())).bfloat16()
    ct.recompress_(y)
    assert torch.equal(ct.decompress().view(torch.int16), y.view(torch.int16))
    index = torch.randint(0, 8192, (7, 3), device="cuda")
    assert torch.equal(ct.decompress_rows(index).view(torch.int16), y[index].view(torch.int16))
    on_cpu = ct.to("cpu")
    assert torch.equal(on_cpu.decompress().view(torch.int16), y.cpu().view(torch.int16))
    back = on_cpu.to("cuda")
    _assert_same_format(back, ct)
    from neutrain.compress import CompressedTensor

    loaded = CompressedTensor.from_state_dict(ct.state_dict())
    assert torch.equal(loaded.decompress().view(torch.int16), y.view(torch.int16))


# ------------------------------------------------------------- grouped launches, sync-free encode
def _layer(device=DEVICE, scale=1):
    """A decoder layer's seven matrices in miniature: different sizes, a partial last tile."""
    shapes = [(16 * scale, 16), (4 * scale, 16), (4 * scale, 16), (16 * scale, 16), (24 * scale, 16),
              (24 * scale, 16), (16, 24 * scale + 3)]
    return [_sample(shape, device) for shape in shapes]


def test_grouped_decode_and_encode_match_per_tensor_in_interpreter():
    from neutrain.compress import decode_many, encode_many

    xs = _layer()
    cts = [compress(x, steps=4, lanes=16, backend="triton") for x in xs]
    assert len({ct.lanes for ct in cts}) == 1  # one group: the grouped kernel really runs
    before = kcodec.COUNTERS["decode"]
    outs = decode_many(cts, [torch.full_like(x, float("nan")) for x in xs], backend="triton")
    assert kcodec.COUNTERS["decode"] == before + 1  # one launch for all seven
    for out, x in zip(outs, xs):
        assert torch.equal(out.view(torch.int16), x.view(torch.int16))
    ys = [(x.float() * 0.999).bfloat16() for x in xs]  # no drift: the same code, so the same bytes
    encode_many(cts, ys, backend="triton")
    for ct, x, y in zip(cts, xs, ys):
        ref = compress(x, steps=4, lanes=16, backend="reference")
        ref.recompress_(y, backend="reference")
        _assert_same_format(ct, ref)
        assert torch.equal(ct.decompress(backend="triton").view(torch.int16), y.view(torch.int16))


def test_sync_free_recompress_matches_reference_in_interpreter():
    x = _sample((13, 11))
    ct = compress(x, steps=4, lanes=16, backend="triton")
    ref = compress(x, steps=4, lanes=16, backend="reference")
    y = (x.float() * 0.999).bfloat16()
    ct.recompress_(y, backend="triton", sync=False)
    ref.recompress_(y, backend="reference")
    assert ct.status.pending  # nothing read back yet
    _assert_same_format(ct, ref)  # stream_words waits for the status
    assert not ct.status.pending


def test_sync_free_overflow_keeps_the_tensor_and_raises_later_in_interpreter():
    from neutrain.compress import StreamOverflowError

    x = _sample((16, 16))
    ct = compress(x, steps=4, lanes=16, backend="triton", name="blocks.0.q")
    ct.stream = ct.stream[: ct.stream_words].clone()  # no headroom left, and no growth seen yet
    ct.status.publish()  # pretend an encode is in flight: the growth rule cannot see its length
    wide = torch.randn(16, 16).mul(torch.randn(16, 16).mul(6).exp2()).bfloat16().to(DEVICE)  # a longer stream
    ct.recompress_(wide, backend="triton", sync=False)
    assert torch.equal(ct.decompress(backend="triton").view(torch.int16), x.view(torch.int16))  # intact
    words, capacity = ct._words, ct.stream.numel()
    with pytest.raises(StreamOverflowError, match="blocks.0.q"):
        ct.stream_words
    # It outgrew its headroom: its stream grew (the old words kept), with twice the headroom if it
    # started below 1/32 (kstream.HEADROOM_SHIFT), else 1/32 again.
    assert ct._headroom_shift == max(kstream.MIN_HEADROOM_SHIFT, kstream.HEADROOM_SHIFT - 1)
    assert ct.stream.numel() == kstream.capacity_for(words, ct._headroom_shift) >= capacity
    assert torch.equal(ct.decompress(backend="triton").view(torch.int16), x.view(torch.int16))
    ct.recompress_(wide, backend="triton", sync=True)  # the synchronous path grows the stream
    assert torch.equal(ct.decompress(backend="triton").view(torch.int16), wide.view(torch.int16))


def test_sync_free_recompress_grows_a_stream_without_headroom_in_interpreter():
    from neutrain.compress import CompressedTensor

    x = _sample((16, 16))
    loaded = CompressedTensor.from_state_dict(compress(x, steps=4, lanes=16, backend="reference").state_dict())
    words = loaded.stream_words
    assert loaded.stream.numel() == kstream.capacity_for(words)  # loaded with a fresh encode's headroom
    loaded.stream = loaded.stream[:words].clone()  # none left: the next sync-free encode must grow first
    y = (x.float() * 1.01).bfloat16()
    loaded.recompress_(y, backend="triton", sync=False)
    assert loaded.stream.numel() > loaded.stream_words
    # A stream that had no headroom to outgrow gets the initial headroom, not a doubled one.
    assert loaded._headroom_shift == kstream.HEADROOM_SHIFT
    assert loaded.stream.numel() == kstream.capacity_for(words)
    assert torch.equal(loaded.decompress(backend="triton").view(torch.int16), y.view(torch.int16))


@pytest.mark.gpu
def test_reencode_and_decode_make_no_host_sync_on_gpu():
    """The training path (CompressedWeight.write_ -> recompress_(sync=False), decode) and the grouped
    calls run under sync_debug_mode("error"): any read back to the host would raise."""
    from neutrain.compress import decode_many, encode_many
    from neutrain.nn import CompressedWeight

    xs = [_sample(shape) for shape in ((2048, 1024), (512, 1024), (1024, 3000))]
    cts = [compress(x) for x in xs]
    refs = [compress(x, backend="reference") for x in xs]
    weight = CompressedWeight(compress(xs[0].clone()), name="w")
    outs = [torch.empty_like(x) for x in xs]
    steps = [[(x.float() + 1e-3 * k * torch.randn_like(x.float())).bfloat16() for x in xs] for k in range(4)]
    # Compile the kernels and build the grouped tables outside the guarded region.
    weight.write_(steps[0][0])
    weight.decode()
    encode_many(cts, steps[0])
    decode_many(cts, outs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for ys in steps[1:]:
            weight.write_(ys[0])
            decoded = weight.decode()
            for ct, y in zip(cts[1:], ys[1:]):
                ct.recompress_(y, sync=False)
            encode_many(cts[:1], ys[:1])
            decode_many(cts, outs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    last = steps[-1]
    assert torch.equal(decoded.view(torch.int16), last[0].view(torch.int16))
    for ct, ref, out, y in zip(cts, refs, outs, last):
        assert torch.equal(out.view(torch.int16), y.view(torch.int16))
        ref.recompress_(y, backend="reference")
        assert ct.rebuilds == ref.rebuilds == 0
        _assert_same_format(ct, ref)  # stream_words settles the lagged status: no overflow was flagged


@pytest.mark.gpu
def test_grouped_calls_match_per_tensor_on_gpu():
    from neutrain.compress import decode_many, encode_many

    xs = _layer(scale=64)
    cts = [compress(x) for x in xs]
    singles = [compress(x) for x in xs]
    outs = decode_many(cts, [torch.full_like(x, float("nan")) for x in xs])
    for out, x in zip(outs, xs):
        assert torch.equal(out.view(torch.int16), x.view(torch.int16))
    ys = [(x.float() * 0.999 + 1e-4).bfloat16() for x in xs]
    encode_many(cts, ys)
    for ct, single, y in zip(cts, singles, ys):
        single.recompress_(y, sync=False)
        _assert_same_format(ct, single)
        assert torch.equal(ct.decompress().view(torch.int16), y.view(torch.int16))


@pytest.mark.gpu
def test_sync_free_reencode_of_every_bf16_pattern_on_gpu():
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32, device="cuda").to(torch.int16)
    x = patterns[torch.randperm(patterns.numel(), device="cuda")].view(torch.bfloat16)
    y = patterns[torch.randperm(patterns.numel(), device="cuda")].view(torch.bfloat16)  # same histogram
    ct = compress(x)
    ct.recompress_(y, sync=False)
    assert ct.rebuilds == 0
    ref = compress(x, backend="reference")
    ref.recompress_(y, backend="reference")
    _assert_same_format(ct, ref)
    assert torch.equal(ct.decompress().view(torch.int16), y.view(torch.int16))


def test_tile_scan_carries_across_blocks_in_interpreter():
    """The prefix sums the pack pass reads (tile bases, totals), over more tiles than one block holds."""
    scratch = torch.randint(0, 1 << 40, (2, 50), dtype=torch.int64, device=DEVICE)
    cum = torch.full_like(scratch, -1)
    kcodec._SCAN((2,), (scratch, cum, 50), {"BLOCK": 16}, num_warps=1)
    assert torch.equal(cum, torch.cumsum(scratch, dim=1))


@pytest.mark.gpu
def test_sync_free_reencode_through_the_compiled_launchers_on_gpu():
    """Re-encodes after the first launch skip Triton's dispatch (kernels.launch) and write the reference's
    bytes, also when the input is a 2-byte-offset view (another specialization) and after the stream grew."""
    x = _sample((1024, 4096))
    ct = compress(x)
    ref = compress(x, backend="reference")
    fast_before = (kcodec._COUNT.fast_launches, kcodec._SCAN.fast_launches, kcodec._PACK.fast_launches)
    buffer = torch.empty(x.numel() + 1, dtype=torch.bfloat16, device="cuda")
    for k in range(6):
        y = (x.float() + 1e-3 * torch.randn_like(x.float())).bfloat16()  # no drift: no code rebuild
        if k in (2, 3):  # unaligned input: Triton would compile another kernel, so must the launcher
            y = buffer[1:].view(x.shape).copy_(y)
        if k == 4:  # no headroom left: this encode grows the stream (a new capacity argument)
            ct.stream = ct.stream[: ct.stream_words].clone()
        ct.recompress_(y, sync=False)
        ref.recompress_(y, backend="reference")
        assert ct.rebuilds == ref.rebuilds == 0
        _assert_same_format(ct, ref)
        assert torch.equal(ct.decompress().view(torch.int16), y.view(torch.int16))
    fast_after = (kcodec._COUNT.fast_launches, kcodec._SCAN.fast_launches, kcodec._PACK.fast_launches)
    assert all(after >= before + 3 for before, after in zip(fast_before, fast_after))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["escapes", "mixed"])
@pytest.mark.parametrize("steps", [16, 32])
def test_decode_window_on_long_codes_and_escapes_on_gpu(kind, steps):
    _check_long_codes(1_000_003, kind, steps, 256, 4, tiles=-(-1_000_003 // (steps * 256 * 4)))
