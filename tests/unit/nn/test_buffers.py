"""Decode buffers: layer slots alternate, large weights stay apart, tags follow versions."""

import pytest
import torch

from neutrain.compress import compress
from neutrain.nn import CompressedWeight
from neutrain.nn.buffers import LARGE_SLOT, LAYER_SLOTS, DecodeBuffers

from .nn_helpers import CODEC


def _weights(n, rows=8):
    return [CompressedWeight(compress(torch.randn(rows, 4).bfloat16(), **CODEC), name=f"w{i}") for i in range(n)]


def test_layer_slots_alternate_and_large_slot_is_separate():
    buffers = DecodeBuffers()
    a, b, c, big = _weights(3) + _weights(1, rows=64)
    big.large = True
    slots = []
    for w in (a, b, c):
        slot = buffers.slot_for(w)
        buffers.view(w, slot)
        slots.append(slot)
    assert slots == [LAYER_SLOTS[0], LAYER_SLOTS[1], LAYER_SLOTS[0]]
    assert buffers.slot_for(big) == LARGE_SLOT
    buffers.view(big, LARGE_SLOT)
    assert buffers.nbytes() == 2 * 8 * 4 * 2 + 64 * 4 * 2  # layer buffers stay layer-sized
    assert buffers.cached(a) is None and buffers.cached(b) is not None and buffers.cached(c) is not None


def test_decode_reuses_current_buffer_and_never_serves_stale_data():
    (w,) = _weights(1)
    first = w.decode()
    assert w.decode().data_ptr() == first.data_ptr() and w.decodes == 1  # served from the buffer
    new = torch.randn(8, 4).bfloat16()
    w.write_(new)
    assert torch.equal(w.decode(), new) and w.decodes == 2  # version bump forced a fresh decode


def test_large_buffer_is_freed_after_use(monkeypatch):
    (w,) = _weights(1, rows=64)
    w.large = True
    from neutrain.nn import DECODE_BUFFERS

    monkeypatch.setitem(DECODE_BUFFERS.keep_bytes, w.device, 0)  # the shared slots, not a kept buffer
    DECODE_BUFFERS.clear()
    w.decode()
    assert DECODE_BUFFERS.nbytes() == 64 * 4 * 2
    w.write_(torch.randn(64, 4).bfloat16())
    assert DECODE_BUFFERS.nbytes() == 0
    w.decode()
    w.release()
    assert DECODE_BUFFERS.nbytes() == 0


def test_a_dead_weights_tag_is_never_served_to_a_new_weight(monkeypatch):
    """Python reuses a freed object's id(); seen on a GPU run, a new model's weight was served a buffer
    tagged for a dead one. Here every object gets the same id(), as a reused one would."""
    import neutrain.nn.buffers as buffers_module

    monkeypatch.setattr(buffers_module, "id", lambda obj: 7, raising=False)
    buffers = DecodeBuffers()
    old, new = _weights(2)
    buffers.view(old, buffers.slot_for(old))
    assert buffers.cached(old) is not None
    assert buffers.cached(new) is None and not buffers.holds(new)


def test_reserve_allocates_every_slot_once_at_its_largest_and_pins_the_large_slot(monkeypatch):
    """Why one pool: slots that grow, or a large slot freed after every use, fragment the CUDA allocator."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    buffers = DecodeBuffers()
    small, big_layer = _weights(1, rows=8) + _weights(1, rows=24)
    (vocab,) = _weights(1, rows=64)
    vocab.large = True
    assert buffers.reserve([small, big_layer, vocab]) == (2 * 24 * 4 + 64 * 4) * 2
    pointers = {slot: buffers._buffers[(small.device, small.dtype, slot)].data_ptr() for slot in (*LAYER_SLOTS, LARGE_SLOT)}
    for w in (small, big_layer, small, big_layer, vocab):
        buffers.view(w, buffers.slot_for(w))
    buffers.release_large(vocab)
    after = {slot: buffers._buffers[(small.device, small.dtype, slot)].data_ptr() for slot in (*LAYER_SLOTS, LARGE_SLOT)}
    assert after == pointers  # nothing was reallocated, the large slot was not freed
    buffers.clear()
    assert buffers.nbytes() == 0


def test_under_expandable_segments_the_large_slot_is_freed_after_use(monkeypatch):
    # Its pages go back to the pool for the decoder layers' backward (the 70B's long-context margin).
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    buffers = DecodeBuffers()
    (layer,) = _weights(1, rows=8)
    (vocab,) = _weights(1, rows=64)
    vocab.large = True
    buffers.reserve([layer, vocab])
    layer_ptr = buffers._buffers[(layer.device, layer.dtype, LAYER_SLOTS[0])].data_ptr()
    buffers.view(vocab, buffers.slot_for(vocab))
    buffers.release_large(vocab)
    assert (vocab.device, vocab.dtype, LARGE_SLOT) not in buffers._buffers
    assert buffers._buffers[(layer.device, layer.dtype, LAYER_SLOTS[0])].data_ptr() == layer_ptr  # still pinned
    assert buffers.reserve([layer, vocab], pin_large=True) and (vocab.device, vocab.dtype, LARGE_SLOT) in buffers._pinned


def test_a_converted_model_has_its_decode_buffers_reserved(monkeypatch):
    # The classic allocator pins the large slot (the CLI, run in-process by other tests, sets expandable segments).
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    from transformers import AutoModelForCausalLM, LlamaConfig

    from neutrain.nn import DECODE_BUFFERS, compress_model

    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    DECODE_BUFFERS.clear()
    compress_model(model, codec_options=CODEC, progress=False)
    assert DECODE_BUFFERS.nbytes() == (96 * 32 + 2 * 48 * 32) * 2
    model.lm_head.compressed.decode()
    model.lm_head.compressed.release()
    assert DECODE_BUFFERS.nbytes() == (96 * 32 + 2 * 48 * 32) * 2  # pinned: not freed after use
    DECODE_BUFFERS.clear()


@pytest.mark.slow
def test_kept_decodes_stay_within_budget_serve_one_version_and_go_with_their_weight(monkeypatch):
    import gc

    from neutrain.nn import DECODE_BUFFERS

    a, b, c = _weights(3)  # 8 x 4 bf16: 64 bytes each
    cpu = torch.device("cpu")
    monkeypatch.setitem(DECODE_BUFFERS.keep_bytes, cpu, DECODE_BUFFERS.kept_nbytes(cpu) + 128)
    for w in (a, b, c):
        w.decode()
    assert [DECODE_BUFFERS.keeps(w) for w in (a, b, c)] == [True, True, False]  # the budget holds two
    for _ in range(3):  # c's slot is overwritten meanwhile; a and b keep theirs
        for w in (a, b, c):
            w.decode()
    assert (a.decodes, b.decodes, c.decodes) == (1, 1, 1)
    kept = a.decode()
    new = torch.randn(8, 4).bfloat16()
    a.write_(new)  # the re-encode invalidates the kept decode: never served stale
    assert not DECODE_BUFFERS.holds(a)
    again = a.decode()
    assert torch.equal(again, new) and a.decodes == 2 and again.data_ptr() == kept.data_ptr()
    used = DECODE_BUFFERS.kept_nbytes(cpu)
    del a, kept, again
    gc.collect()
    assert DECODE_BUFFERS.kept_nbytes(cpu) == used - 64  # a dropped weight gives its bytes back
    (d,) = _weights(1)
    d.decode()
    assert DECODE_BUFFERS.keeps(d)  # ... to the next weight decoded
    DECODE_BUFFERS.clear()
    assert not DECODE_BUFFERS.keeps(b) and DECODE_BUFFERS.kept_nbytes() == 0


def test_offloaded_weights_are_never_kept(monkeypatch):
    (w,) = _weights(1)
    buffers = DecodeBuffers()
    buffers.keep_bytes[w.device] = 1 << 20
    w.home = object()  # a WeightOffload: its decoded copy would defeat the offload
    assert buffers.kept_view(w) is None and not buffers.keeps(w)
    w.home = None
    assert buffers.kept_view(w) is not None and buffers.keeps(w)
