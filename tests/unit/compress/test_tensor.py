"""CompressedTensor API: out buffers, recompress_, rows, moving, saving and corruption."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from neutrain.compress import CompressedTensor, CorruptTensorError, compress
from neutrain.compress.format import BLOB_KEYS


def _same_bits(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_metadata_and_size_accounting():
    x = torch.randn(300, 500).mul(0.02).bfloat16()
    ct = compress(x, name="layer.w")
    assert ct.shape == x.shape and ct.dtype == torch.bfloat16 and ct.device == x.device
    assert ct.nbytes == sum(t.numel() * t.element_size() for t in
                            (ct.stream, ct.tails, ct.lane_words, ct.tile_base, ct.enc_table, ct.lut)) + 258
    assert ct.bits_per_weight == pytest.approx(8 * ct.nbytes / x.numel())
    assert "layer" not in repr(ct) and "bits/weight" in repr(ct)


def test_decompress_into_out_and_out_validation():
    x = torch.randn(64, 48).bfloat16()
    ct = compress(x)
    out = torch.full_like(x, float("nan"))
    assert ct.decompress(out=out) is out and _same_bits(out, x)
    with pytest.raises(ValueError):
        ct.decompress(out=torch.empty(48, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        ct.decompress(out=torch.empty(64, 48, dtype=torch.float16))
    with pytest.raises(ValueError):
        ct.decompress(out=torch.empty(48, 64, dtype=torch.bfloat16).t())


def test_recompress_reuses_buffers_and_grows_when_needed():
    x = torch.randn(200, 300).mul(0.02).bfloat16()
    ct = compress(x)
    ptrs = {name: getattr(ct, name).data_ptr() for name in ("tails", "lane_words", "tile_base")}
    y = (x.float() * 0.999).bfloat16()  # same distribution: fits or nearly fits
    ct.recompress_(y)
    assert _same_bits(ct.decompress(), y)
    assert all(getattr(ct, name).data_ptr() == ptr for name, ptr in ptrs.items())
    stream_ptr, capacity = ct.stream.data_ptr(), ct.stream.numel()
    z = (x.float() * 1.001).bfloat16()
    ct.recompress_(z)
    assert _same_bits(ct.decompress(), z)
    if ct.stream_words <= capacity:
        assert ct.stream.data_ptr() == stream_ptr
    wide = torch.randn(200, 300).mul(torch.randn(200, 300).mul(6).exp2()).bfloat16()  # many more exponents
    ct.recompress_(wide)
    assert ct.stream.numel() >= ct.stream_words > capacity  # grew
    assert _same_bits(ct.decompress(), wide)


def test_stream_headroom_is_a_32nd_and_growing_keeps_the_data():
    from neutrain.compress import stream as kstream

    x = torch.randn(512, 512).mul(0.02).bfloat16()
    ct = compress(x)
    words = ct.stream_words
    assert ct.stream.numel() == words + words // 32 + 64  # a new tensor: 1/32 (1/2048 overflowed on the GPU)
    for _ in range(2):
        kstream.grow(ct, words)
        assert ct._headroom_shift == 5 and ct.stream.numel() == words + (words >> 5) + 64
        assert _same_bits(ct.decompress(), x)  # the used words moved with it
    assert not kstream.needs_growth(words, ct.stream.numel(), ct._headroom_shift)
    assert kstream.needs_growth(ct.stream.numel() - 32, ct.stream.numel(), ct._headroom_shift)
    ct._headroom_shift = 11  # a smaller start earns room by growing, doubled each time up to 1/32
    for shift in [10, 9, 8, 7, 6, 5, 5]:
        kstream.grow(ct, words)
        assert ct._headroom_shift == shift and ct.stream.numel() == words + (words >> shift) + 64


def test_a_loaded_tensor_has_the_headroom_of_a_fresh_one_so_its_first_update_grows_nothing():
    """A resumed run's first sync-free re-encode grew every stream loaded without headroom (a new stream allocated
    while the old lived): Llama-3-8B's resumed first step then ran out of memory at an 11 GiB budget."""
    from neutrain.compress import stream as kstream

    x = torch.randn(512, 512).mul(0.02).bfloat16()
    ct = compress(x)
    loaded = CompressedTensor.from_state_dict(ct.state_dict())
    assert loaded.stream_words == ct.stream_words
    assert loaded.stream.numel() == kstream.capacity_for(ct.stream_words) == ct.stream.numel()
    assert not kstream.needs_growth(loaded.stream_words, loaded.stream.numel(), loaded._headroom_shift)
    assert torch.equal(loaded.state_dict()["stream"], ct.state_dict()["stream"])  # the same saved bytes
    assert _same_bits(loaded.decompress(), x)
    assert loaded.to("cpu").stream.numel() == loaded.stream.numel()


def test_a_checkpoint_of_the_old_geometry_loads_decodes_and_keeps_it():
    x = torch.randn(1024, 256).mul(0.02).bfloat16()
    assert compress(x).steps == 16  # under 8M weights: 16 steps per lane
    saved = compress(x, steps=32).state_dict()  # what compress chose before
    loaded = CompressedTensor.from_state_dict(saved)
    assert loaded.steps == 32
    for backend in ("auto", "reference"):
        assert _same_bits(loaded.decompress(backend=backend), x)
    y = (x.float() * 0.999).bfloat16()
    loaded.recompress_(y)
    assert loaded.steps == 32 and _same_bits(loaded.decompress(), y)


def test_recompress_rebuilds_code_on_drift_only():
    x = torch.randn(256, 256).mul(0.02).bfloat16()
    ct = compress(x)
    ct.recompress_((x.float() + 1e-4 * torch.randn_like(x.float())).bfloat16())
    assert ct.rebuilds == 0
    drifted = torch.randn(256, 256).mul(3.0).bfloat16()  # exponents the code never saw: escapes
    before = ct.code_lengths.copy()
    ct.recompress_(drifted)
    assert ct.rebuilds == 1 and (ct.code_lengths != before).any()
    assert _same_bits(ct.decompress(), drifted)
    fresh = compress(drifted)
    assert ct.stream_words == fresh.stream_words  # same code as a fresh compress


def test_recompress_rejects_other_shapes():
    ct = compress(torch.randn(4, 4).bfloat16())
    with pytest.raises(ValueError):
        ct.recompress_(torch.randn(4, 5).bfloat16())


@pytest.mark.parametrize("shape", [(97, 33), (5, 7, 11), (3000, 40)])
def test_decompress_rows_matches_full_decode(shape):
    x = torch.randn(*shape).bfloat16()
    ct = compress(x, steps=8, lanes=16)
    index = torch.tensor([[0, shape[0] - 1], [shape[0] // 2, 1]])
    rows = ct.decompress_rows(index)
    assert rows.shape == (2, 2, *shape[1:]) and _same_bits(rows, x[index])


def test_to_same_device_and_copy():
    ct = compress(torch.randn(10, 10).bfloat16())
    assert ct.to("cpu") is ct


@pytest.mark.parametrize("kept", [None, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_state_dict_roundtrip_through_safetensors(tmp_path, kept, dtype):
    x = torch.randn(123, 45).to(dtype)
    ct = compress(x, kept, name="model.layers.0.mlp.up_proj.weight")
    path = tmp_path / "w.safetensors"
    save_file(ct.state_dict(), str(path))
    again = CompressedTensor.from_state_dict(load_file(str(path)))
    assert again.name == "model.layers.0.mlp.up_proj.weight" and again.mantissa_bits == ct.mantissa_bits
    assert torch.equal(again.decompress(), ct.decompress())
    again.recompress_(x)  # a loaded tensor stays updatable
    assert torch.equal(again.decompress(), ct.decompress())


@pytest.mark.parametrize("key", BLOB_KEYS + ("checksum",))
def test_any_flipped_byte_is_detected_and_names_the_tensor(key):
    ct = compress(torch.randn(70, 90).mul(0.02).bfloat16(), name="blocks.3.attn.q")
    state = ct.state_dict()
    generator = torch.Generator().manual_seed(len(key))
    for _ in range(3):
        corrupt = {k: v.clone() for k, v in state.items()}
        raw = corrupt[key].view(-1).view(torch.uint8)
        pos = int(torch.randint(0, raw.numel(), (1,), generator=generator))
        raw[pos] ^= int(torch.randint(1, 256, (1,), generator=generator))
        with pytest.raises(CorruptTensorError, match="blocks.3.attn.q"):
            CompressedTensor.from_state_dict(corrupt)
        with pytest.raises(CorruptTensorError, match="given_name"):
            CompressedTensor.from_state_dict(corrupt, name="given_name")
    CompressedTensor.from_state_dict(state)  # the untouched state still loads


def test_missing_entry_is_reported():
    state = compress(torch.randn(8, 8).bfloat16(), name="w").state_dict()
    del state["tails"]
    with pytest.raises(CorruptTensorError, match="missing"):
        CompressedTensor.from_state_dict(state)


def test_histogram_is_built_in_chunks_with_the_same_result(monkeypatch):
    import neutrain.compress.tensor as tensor_module

    x = torch.randn(50, 97).mul(0.02).bfloat16()
    whole = compress(x)
    monkeypatch.setattr(tensor_module, "_HISTOGRAM_CHUNK", 1000)
    chunked = compress(x)
    assert (chunked.code_lengths == whole.code_lengths).all()
    assert torch.equal(chunked.stream[: chunked.stream_words], whole.stream[: whole.stream_words])


def test_resumed_tensor_rebuilds_exactly_like_the_original():
    x = torch.randn(128, 128).mul(0.02).bfloat16()
    original = compress(x)
    resumed = CompressedTensor.from_state_dict(original.state_dict())
    generator = torch.Generator().manual_seed(3)
    for scale in (1.0, 1.5, 4.0, 20.0):  # growing drift: some steps rebuild, some do not
        y = (torch.randn(128, 128, generator=generator) * 0.02 * scale).bfloat16()
        original.recompress_(y)
        resumed.recompress_(y)
        assert resumed.rebuilds == original.rebuilds
        assert torch.equal(resumed.stream[: resumed.stream_words], original.stream[: original.stream_words])
    assert original.rebuilds >= 1


def _saved_and_loaded(ct):
    """A copy of ``ct``'s state dict (as a checkpoint holds it) and the tensor loaded from it."""
    saved = {k: v.clone() for k, v in ct.state_dict().items()}
    return saved, CompressedTensor.from_state_dict({k: v.clone() for k, v in saved.items()})


def _assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    differing = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not differing, f"blobs differing: {differing}"


@pytest.mark.slow
def test_a_loaded_tensor_decides_its_sync_free_code_rebuild_as_the_saved_one_would():
    """The encoder that runs without host reads (the GPU's: here Triton's interpreter) decides whether to
    rebuild the code from the coded bits of the *previous* encode. A loaded tensor must know those bits:
    taking them as the code's size at build delayed its rebuild by one update, so a resumed run stored
    the same values with another code (the checkpoint's stream, tile table and header differed).
    On a GPU machine the kernels run on the GPU."""
    # 16 rows, as few as keep the check: the interpreter's time grows with the elements, and at this size the
    # drift below still moves the coded bits 3.6 % (a loaded tensor without them still rebuilds one update late).
    x = torch.randn(16, 256).mul(0.02).bfloat16().to("cuda" if torch.cuda.is_available() else "cpu")
    ct = compress(x, steps=4, lanes=16, backend="triton", name="lm_head.weight")
    drifted = (x.float() * 1.3).bfloat16()  # coded bits 3.6 % up: past REBUILD_GROWTH, inside the headroom
    ct.recompress_(drifted, backend="triton", sync=False)  # sync-free: no rebuild decided on these values
    assert ct.rebuilds == 0
    saved, resumed = _saved_and_loaded(ct)  # saving takes in the encode's status, as a checkpoint does
    _assert_same_state(resumed, ct)
    for scale in (1.302, 1.304):  # the next updates, the same on both
        y = (x.float() * scale).bfloat16()
        ct.recompress_(y, backend="triton", sync=False)
        resumed.recompress_(y, backend="triton", sync=False)
        assert resumed.rebuilds == ct.rebuilds
        _assert_same_state(resumed, ct)
    assert ct.rebuilds == 1 and _same_bits(resumed.decompress(backend="triton"), y)


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_a_loaded_tensor_chooses_block_or_whole_re_encode_as_the_saved_one_would(backend):
    """A block-by-block re-encode (row blocks of a vocabulary matrix) keeps the code; the next update
    re-encodes whole, rebuilding it, when that re-encode's coded bits drifted. A loaded tensor must
    make the same choice."""
    from neutrain.compress.blocks import block_recode, tile_numel

    x = torch.randn(64, 256).mul(0.02).bfloat16()
    ct = compress(x, steps=4, lanes=16, backend=backend, name="model.embed_tokens.weight")

    def update(t, new):
        recode = block_recode(t, backend)
        if recode is None:
            t.recompress_(new, backend=backend)
            return "whole"
        tile_len = tile_numel(t)
        for first in range(0, t.tiles, 2):
            stop = min(first + 2, t.tiles)
            block = recode.decode(first, stop, torch.empty((stop - first) * tile_len, dtype=t.dtype))
            block.copy_(new.reshape(-1)[first * tile_len : first * tile_len + block.numel()])
            recode.encode(first, block)
        recode.finish()
        return "blocks"

    assert update(ct, (x.float() * 1.3).bfloat16()) == "blocks"  # coded bits 3.6 % up, the code kept
    _, resumed = _saved_and_loaded(ct)
    y = (x.float() * 1.302).bfloat16()
    assert update(resumed, y) == update(ct, y) == "whole"
    assert resumed.rebuilds == ct.rebuilds == 1
    _assert_same_state(resumed, ct)


def test_a_tensor_saved_by_the_previous_codec_still_loads_and_trains():
    """data/codec_b82cf91.safetensors was written by commit b82cf91 (64 steps per lane, before the
    sync-free encoder and the 32-step default), with a version-1 header (no coded bits of the encoding):
    it loads as it is, and is saved again with a version-2 header."""
    from pathlib import Path

    blobs = load_file(str(Path(__file__).parent / "data" / "codec_b82cf91.safetensors"))
    original = blobs.pop("original")
    state = {k[len("w."):]: v for k, v in blobs.items()}
    ct = CompressedTensor.from_state_dict(state)
    assert ct.name == "layers.0.mlp.up_proj.weight" and ct.steps == 64
    assert _same_bits(ct.decompress(), original)
    updated = (original.float() * 0.999).bfloat16()
    ct.recompress_(updated, sync=False)
    assert int(state["header"][0]) == 1 and int(ct.state_dict()["header"][0]) == 2
    again = CompressedTensor.from_state_dict(ct.state_dict())
    assert again.steps == 64 and _same_bits(again.decompress(), updated)
