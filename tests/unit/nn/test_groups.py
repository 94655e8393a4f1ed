"""Layer groups (neutrain.nn.groups): a layer's matrices decoded together, updated in place, encoded together.

On the CPU the grouped launches fall back to per-tensor decodes and encodes with the same bytes, so these tests
check the bookkeeping (what is decoded when, what is pending, what is encoded before anything reads it) and that
training stays bit for bit dense training; the GPU twin (test_groups_gpu.py) runs the grouped kernels.
"""

import copy
from collections import Counter

import pytest
import torch

from neutrain.compress import compress
from neutrain.errors import UserInputError
from neutrain.nn import CompressedWeight, compress_model, compressed_weights
from neutrain.nn.groups import LAYER_GROUPS, LayerGroups, WeightGroup, form_groups
from neutrain.optim import LOMO, AdaLomo

from .nn_helpers import CODEC, enable_checkpointing, tiny_llama, token_batches, train, weights


@pytest.fixture
def grouped(monkeypatch):
    """Groups formed for any model on the CPU (and no kept decodes, which would take precedence)."""
    from neutrain.nn import DECODE_BUFFERS

    monkeypatch.setenv("NEUTRAIN_LAYER_GROUPS", "1")
    monkeypatch.setitem(DECODE_BUFFERS.keep_bytes, torch.device("cpu"), 0)


def _compressed_copy(dense):
    model = copy.deepcopy(dense)
    compress_model(model, progress=False, codec_options=CODEC)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [True, False], ids=["ckpt", "no-ckpt"])
@pytest.mark.parametrize(
    "make_opt",
    [lambda p: LOMO(p, lr=0.1, stochastic_rounding=False),
     lambda p: AdaLomo(p, lr=2e-2, clip_mode="per_tensor", max_grad_norm=1.0, seed=3)],
    ids=["lomo", "adalomo"])
def test_grouped_training_is_bit_identical_to_dense_and_decodes_each_layer_twice_a_step(grouped, make_opt,
                                                                                        checkpointing):
    dense = tiny_llama(layers=3)
    compressed = _compressed_copy(dense)
    groups = {w.group for w in compressed_weights(compressed) if w.group is not None}
    assert len(groups) == 3 and all(len(g.members) == 7 for g in groups)
    if checkpointing:
        enable_checkpointing(dense)
        enable_checkpointing(compressed)
    data = token_batches(3, seed=5)
    start = weights(dense)
    q_proj = compressed.model.layers[1].self_attn.q_proj.compressed
    before, grouped_before, encodes_before = q_proj.decodes, LAYER_GROUPS.decodes, LAYER_GROUPS.encodes
    assert train(dense, make_opt(dense.parameters()), data) == train(compressed, make_opt(compressed.parameters()), data)
    a, b = weights(dense), weights(compressed)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert sum(int((a[n] != start[n]).sum()) for n in a) > sum(t.numel() for t in a.values()) / 2
    # Two decodes of a layer a step: the forward's, and in backward the recompute's (with checkpointing) or the
    # backward's own (the loss's vocabulary matrix took the buffers back in between); the backward's matrix
    # products and updates find the layer in the buffer.
    passes = 2
    assert q_proj.decodes - before == passes * len(data)
    assert LAYER_GROUPS.decodes - grouped_before == passes * 3 * len(data)
    assert LAYER_GROUPS.encodes - encodes_before == 3 * len(data)  # one grouped encode per layer and step
    assert not any(any(g.pending) for g in groups)
    assert all(w.version == len(data) for g in groups for w in g.members)


def _group_of(n_members=3, seed=0, registry=None):
    torch.manual_seed(seed)
    ws = [CompressedWeight(compress(torch.randn(16, 8).bfloat16(), steps=16), name=f"w{seed}.{i}")
          for i in range(n_members)]
    return ws, WeightGroup(ws, registry or LayerGroups())


def _update_in_place(weight, delta=1.0):
    """What the fused update does: read, write into what was read, hand it back."""
    view = weight.read()
    new = view.float().add_(delta).bfloat16()
    view.copy_(new)
    weight.write_(view)
    return new


def test_a_pending_update_is_encoded_before_its_compressed_tensor_is_read():
    ws, group = _group_of()
    new = _update_in_place(ws[0])
    assert group.pending[0] and ws[0].version == 1
    # Reading ws[0].ct (a checkpoint save, an export) encodes the pending member first.
    assert torch.equal(ws[0].ct.decompress().view(torch.int16), new.view(torch.int16))
    assert not any(group.pending)


def test_the_layer_is_encoded_once_its_last_trainable_member_is_updated():
    registry = LayerGroups()
    ws, group = _group_of(registry=registry)
    ws[2].key.requires_grad_(False)  # frozen after the build: not waited for
    news = [_update_in_place(w, d) for w, d in zip(ws[:2], (1.0, 2.0))]
    assert registry.encodes == 1 and not any(group.pending)
    for w, new in zip(ws, news):
        assert torch.equal(w._ct.decompress().view(torch.int16), new.view(torch.int16))


def test_a_buffer_taken_for_another_layer_encodes_its_holder_first():
    registry = LayerGroups()
    (ws0, g0), (ws1, g1) = [_group_of(seed=s, registry=registry) for s in range(2)]
    new = _update_in_place(ws0[1])
    assert g0.pending[1] and g0.buffer is not None
    ws1[0].decode()  # takes the first layer's buffer
    assert g0.buffer is None and not any(g0.pending) and g1.buffer is not None
    assert torch.equal(ws0[1]._ct.decompress().view(torch.int16), new.view(torch.int16))
    # Decoded again from its encoding, the update is there.
    assert torch.equal(ws0[1].decode().view(torch.int16), new.view(torch.int16))


def test_release_encodes_what_is_pending_and_frees_the_buffers():
    registry = LayerGroups()
    ws, group = _group_of(registry=registry)
    new = _update_in_place(ws[2])
    assert registry.nbytes() > 0
    registry.release()
    assert registry.nbytes() == 0 and group.buffer is None
    assert torch.equal(ws[2]._ct.decompress().view(torch.int16), new.view(torch.int16))


def test_a_write_of_another_tensor_is_encoded_at_once():
    ws, group = _group_of()
    ws[0].decode()
    other = torch.randn(16, 8).bfloat16()
    ws[0].write_(other)
    assert not group.pending[0] and ws[0].version == 1
    assert torch.equal(ws[0].decode().view(torch.int16), other.view(torch.int16))


def test_replacing_a_members_tensor_drops_the_stale_copy():
    ws, group = _group_of()
    ws[1].decode()
    replacement = torch.randn(16, 8).bfloat16()
    ws[1].replace_(compress(replacement, steps=16))
    assert torch.equal(ws[1].decode().view(torch.int16), replacement.view(torch.int16))


def test_offloading_a_layer_ungroups_it(grouped):
    from neutrain.nn.weight_offload_model import offload_weights

    model = _compressed_copy(tiny_llama(layers=2))
    assert all(w.group is not None for w in compressed_weights(model.model.layers[0]))
    offload_weights(model)
    assert all(w.group is None and w.home is not None for w in compressed_weights(model.model.layers[0]))


def test_groups_form_by_default_only_on_a_gpu_and_where_a_layer_fits_the_vocabulary_buffer(monkeypatch):
    monkeypatch.delenv("NEUTRAIN_LAYER_GROUPS", raising=False)
    model = _compressed_copy(tiny_llama(layers=2))
    assert all(w.group is None for w in compressed_weights(model))  # a CPU model: never by default
    monkeypatch.setenv("NEUTRAIN_LAYER_GROUPS", "0")
    assert form_groups(model, compressed_weights, lambda device: False) == 0
    monkeypatch.setenv("NEUTRAIN_LAYER_GROUPS", "sometimes")
    with pytest.raises(UserInputError, match="NEUTRAIN_LAYER_GROUPS"):
        form_groups(model, compressed_weights, lambda device: False)


def test_the_group_buffer_is_the_large_slots_memory_and_a_vocabulary_decode_takes_it_back(grouped):
    from neutrain.nn import DECODE_BUFFERS

    model = _compressed_copy(tiny_llama(layers=2))
    q_proj = model.model.layers[0].self_attn.q_proj.compressed
    head = model.lm_head.compressed
    group = q_proj.group
    view = q_proj.decode()
    large = DECODE_BUFFERS._buffers[(head.device, head.dtype, "large")]
    assert group.buffer.tensor.data_ptr() == large.data_ptr()  # no memory of its own
    new = _update_in_place(q_proj, 3.0)
    assert group.pending[q_proj.group_index]
    expected_head = head._ct.decompress()
    assert torch.equal(head.decode().view(torch.int16), expected_head.view(torch.int16))
    # The lm_head's decode overwrote the shared memory: the pending update was encoded before, nothing was lost.
    assert group.buffer is None and not any(group.pending)
    assert torch.equal(q_proj._ct.decompress().view(torch.int16), new.view(torch.int16))
    assert torch.equal(q_proj.decode().view(torch.int16), new.view(torch.int16))
    assert view.data_ptr() == q_proj.decode().data_ptr()


def _backward_nodes(output: torch.Tensor) -> Counter:
    seen, names, todo = set(), Counter(), [output.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names[type(node).__name__] += 1
        todo.extend(next_node for next_node, _ in node.next_functions)
    return names


@pytest.mark.parametrize("checkpointing", [True, False], ids=["ckpt", "no-ckpt"])
def test_a_checkpointed_grouped_layer_runs_native_products_and_an_unchecked_one_keeps_its_own(grouped,
                                                                                          checkpointing):
    # Inside a checkpoint nothing saved outlives the layer's backward, so the layer's products are nn.Linear's
    # own (no Python autograd node a matrix: the host cost that set a small batch's pace). Outside one, the
    # forward's saved weights would be overwritten by the next layer's decode: the product keeps a node that
    # decodes again in backward.
    model = tiny_llama(layers=2)
    compress_model(model, progress=False, codec_options=CODEC)
    if checkpointing:
        enable_checkpointing(model)
    LOMO(model.parameters(), lr=0.1).bind(model)
    ids = token_batches(1, seed=1)[0]
    out = model(input_ids=ids, labels=ids).loss
    functions = _backward_nodes(out)["_CompressedLinearFunctionBackward"]
    # The vocabulary matrix (lm_head) is never grouped: one function node either way.
    assert functions == (1 if checkpointing else 1 + 2 * 7)
    out.backward()  # every member updated once, through its leaf's hook or its function
    groups = {w.group for w in compressed_weights(model) if w.group is not None}
    assert groups and all(w.version == 1 for g in groups for w in g.members)
    assert all(leaf is None or leaf.grad is None for g in groups for leaf in g.leaves)  # no .grad kept


@pytest.mark.slow
def test_a_layer_that_also_decodes_a_large_weight_keeps_its_products_decoding_and_trains_as_dense(grouped):
    # A mixture of experts' stacks are large weights of the layer: their decode in the layer's backward takes the
    # group buffer's memory between the recompute and the attention products' backward, so those products may
    # not keep the forward's view of it (they decode again).
    from transformers import AutoModelForCausalLM, MixtralConfig

    cfg = MixtralConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=256, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=64)
    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).train()
    compressed = _compressed_copy(dense)
    groups = {w.group for w in compressed_weights(compressed) if w.group is not None}
    assert len(groups) == 2 and not any(g.native for g in groups)
    enable_checkpointing(dense)
    enable_checkpointing(compressed)
    data = token_batches(2, seed=4)
    train(dense, LOMO(dense.parameters(), lr=0.1, stochastic_rounding=False), data)
    train(compressed, LOMO(compressed.parameters(), lr=0.1, stochastic_rounding=False), data)
    a, b = weights(dense), weights(compressed)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.slow
def test_a_copied_grouped_model_shares_the_buffers_registry_and_trains_as_its_original(grouped):
    # A copy of the registry would not hear the vocabulary decode take the buffer back (its layers would read
    # the lm_head's values); a pending update is encoded before the copy takes the compressed bytes.
    dense = tiny_llama(layers=2)
    compressed = _compressed_copy(dense)
    enable_checkpointing(dense)
    enable_checkpointing(compressed)
    data = token_batches(2, seed=6)
    train(dense, LOMO(dense.parameters(), lr=0.1, stochastic_rounding=False), data[:1])
    train(compressed, LOMO(compressed.parameters(), lr=0.1, stochastic_rounding=False), data[:1])
    ws = [w for w in compressed_weights(compressed) if w.group is not None]
    _update_in_place(ws[0], delta=0.0)  # a pending member (no change of value) at the moment of the copy
    assert ws[0].group.pending[ws[0].group_index]
    twin = copy.deepcopy(compressed)
    twin_groups = {w.group for w in compressed_weights(twin) if w.group is not None}
    assert twin_groups and all(g.registry is LAYER_GROUPS and g.buffer is None for g in twin_groups)
    train(dense, LOMO(dense.parameters(), lr=0.1, stochastic_rounding=False), data[1:])
    train(twin, LOMO(twin.parameters(), lr=0.1, stochastic_rounding=False), data[1:])
    a, b = weights(dense), weights(twin)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
