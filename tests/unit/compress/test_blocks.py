"""Block-by-block re-encode (neutrain.compress.blocks): exact values, and the bytes of a whole encode.

The Triton backend runs in the interpreter on CPU (conftest sets TRITON_INTERPRET=1); it
moves no floats through casts, so the interpreter's rounding quirks do not apply.
"""

import pytest
import torch

from neutrain.compress import compress
from neutrain.compress.blocks import aligned_rows, block_recode, tile_numel
from neutrain.compress.stream import StreamOverflowError
from neutrain.compress.tensor import CompressedTensor

BACKENDS = ["reference", "auto", pytest.param("triton", marks=pytest.mark.filterwarnings("ignore"))]


def _weights(rows=40, cols=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g).mul(0.02).bfloat16()


def _recode_by_blocks(ct, new, block_tiles, backend):
    recode = block_recode(ct, backend)
    assert recode is not None
    tile_len = tile_numel(ct)
    flat = new.reshape(-1)
    for first in range(0, ct.tiles, block_tiles):
        stop = min(first + block_tiles, ct.tiles)
        buffer = torch.empty((stop - first) * tile_len, dtype=ct.dtype)
        old = recode.decode(first, stop, buffer)
        start = first * tile_len
        assert old.numel() == min(stop * tile_len, ct.numel) - start
        old.copy_(flat[start : start + old.numel()])  # the update, in the block buffer
        recode.encode(first, old)
    recode.finish()


def _copy(ct):
    return CompressedTensor.from_state_dict({k: v.clone() for k, v in ct.state_dict().items()})


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_tiles", [1, 3])
def test_block_recode_writes_the_bytes_of_a_whole_encode(backend, block_tiles):
    w = _weights()
    ct = compress(w, steps=4, lanes=16, backend=backend)  # 256-element tiles; 3840 elements: 15 tiles
    new = w.float().add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(1)) * 1e-3).bfloat16()
    new.view(-1)[:3] = torch.tensor([float("inf"), 3.0e38, -0.0])  # exponents without a code: escapes
    whole = _copy(ct)
    whole._encode(new, backend, fresh_code=True)  # the same code table, whole tensor at once
    _recode_by_blocks(ct, new, block_tiles, backend)
    assert torch.equal(ct.decompress(backend="reference").view(torch.int16), new.view(torch.int16))
    assert ct.stream_words == whole.stream_words
    assert torch.equal(ct.stream[: ct.stream_words], whole.stream[: whole.stream_words])
    for field in ("tails", "lane_words", "tile_base"):
        assert torch.equal(getattr(ct, field), getattr(whole, field)), field


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_block_recode_of_a_partial_last_tile(backend):
    w = _weights(rows=37, cols=29)  # 1073 elements: the last of 5 tiles is partial
    ct = compress(w, steps=4, lanes=16, backend=backend)
    new = _weights(rows=37, cols=29, seed=3)
    _recode_by_blocks(ct, new, 2, backend)
    assert torch.equal(ct.decompress().view(torch.int16), new.view(torch.int16))
    ct.recompress_(w, backend=backend)  # the usual whole encode still works after a block re-encode
    assert torch.equal(ct.decompress().view(torch.int16), w.view(torch.int16))


def test_blocks_go_in_order_and_all_of_them():
    ct = compress(_weights(), steps=4, lanes=16, backend="reference")
    recode = block_recode(ct, "reference")
    block = torch.empty(2 * tile_numel(ct), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="in order"):
        recode.encode(2, recode.decode(2, 4, block))
    recode.encode(0, recode.decode(0, 2, block))
    with pytest.raises(ValueError, match="re-encoded already"):
        recode.decode(1, 3, block)
    with pytest.raises(ValueError, match="not re-encoded"):
        recode.finish()


def test_no_block_recode_when_the_code_is_due_for_a_rebuild_or_lossy():
    w = _weights()
    ct = compress(w, steps=4, lanes=16, backend="reference")
    ct._coded_seen = 2 * ct._coded_bits_at_build  # as if the last encode had drifted past REBUILD_GROWTH
    assert block_recode(ct, "reference") is None
    assert block_recode(compress(w, 3, steps=4, lanes=16, backend="reference"), "reference") is None


@pytest.mark.slow
def test_an_overflowing_block_recode_is_reported_not_silent():
    w = _weights()
    ct = compress(w, steps=4, lanes=16, backend="triton")
    recode = block_recode(ct, "triton")
    recode.stream = recode.stream[:8]  # far too small for the new stream
    huge = torch.full_like(w, 3.0e38)  # no code for this exponent: escapes everywhere
    tile_len = tile_numel(ct)
    for first in range(ct.tiles):
        recode.decode(first, first + 1, torch.empty(tile_len, dtype=torch.bfloat16))
        recode.encode(first, huge.view(-1)[first * tile_len : (first + 1) * tile_len])
    recode.finish()
    with pytest.raises(StreamOverflowError, match="value is lost"):
        ct.recompress_(w, backend="triton", sync=False)


@pytest.mark.slow
def test_aligned_rows_are_whole_tiles():
    ct = compress(_weights(rows=64, cols=96), steps=4, lanes=16)  # 256-element tiles, 96-element rows
    for rows in (1, 2, 5, 8):
        aligned = aligned_rows(ct, rows)
        assert aligned % rows == 0 and aligned * 96 % 256 == 0
        assert (aligned // 2) * 96 % 256 != 0 or aligned // 2 % rows != 0  # the smallest such multiple


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_repeated_block_recodes_keep_the_stream_capacity(backend):
    # The second stream has 1/32 headroom over the last length (an overflow there loses the value),
    # taken once: a per-update margin on top of the capacity would compound step after step.
    from neutrain.compress import stream as kstream

    w = _weights()
    ct = compress(w, steps=4, lanes=16, backend=backend)
    ct.recompress_(w, backend=backend, sync=False)  # a sync-free encode sizes the capacity as training does
    capacity = None
    for seed in range(3):
        new = w.float().add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(seed)) * 1e-4).bfloat16()
        _recode_by_blocks(ct, new, 4, backend)
        assert ct.stream.numel() >= kstream.capacity_for(ct.stream_words - 64, kstream.MIN_HEADROOM_SHIFT) - 64
        capacity = capacity or ct.stream.numel()
        assert ct.stream.numel() == capacity
        assert torch.equal(ct.decompress(backend="reference").view(torch.int16), new.view(torch.int16))
