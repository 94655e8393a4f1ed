"""Where the dispatch table picks SDPA, ``neutrain_sage`` is transformers' ``sdpa``, and reads packing once.

A GPU call whose table entry says SDPA runs the very function ``attn_implementation="sdpa"`` runs, so a
recipe asking for ``neutrain_sage`` trains bit for bit as one asking for SDPA (and no slower). Whether the
rows are packed is read on the host (a device synchronisation on a GPU) once per ``position_ids`` tensor:
the decoder passes one tensor to every layer and checkpointing's recompute passes it again. On this CPU the
dispatch is made to run by naming a device for it (``dispatch_device``); a device the table does not know
gets SDPA, as on a GPU.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from neutrain.attention import counters, register, registration, reset_counters
from neutrain.nn import causal_lm_loss


def _model(attn, layers=2, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97, max_position_embeddings=256)  # head dim 64, GQA 2
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _step(model, ids, **kwargs):
    loss = model(ids, labels=ids, **kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture
def table_picks_sdpa(monkeypatch):
    register()
    monkeypatch.setattr(registration, "dispatch_device", lambda query: "a GPU the table has not measured")
    monkeypatch.delenv("NEUTRAIN_SAGE_DISPATCH", raising=False)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["table", "never"])
def test_a_call_dispatched_to_sdpa_trains_bit_for_bit_as_transformers_sdpa(table_picks_sdpa, monkeypatch, policy):
    monkeypatch.setenv("NEUTRAIN_SAGE_DISPATCH", policy)
    ids = torch.randint(0, 97, (2, 48), generator=torch.Generator().manual_seed(3))
    reset_counters()
    loss, grads = _step(_model("neutrain_sage"), ids)
    assert counters["fallback"] == 2 * 2 and counters["reference"] == 0  # two layers, forward and recompute
    assert any(k.startswith("fallback:dispatch: ") for k in counters), dict(counters)
    want_loss, want = _step(_model("sdpa"), ids)
    assert torch.equal(loss, want_loss)
    for name, grad in want.items():
        assert torch.equal(grads[name], grad), name


@pytest.mark.slow
def test_packing_is_read_once_per_step_and_not_at_all_inside_contiguous_positions(table_picks_sdpa, monkeypatch):
    reads = []
    original = registration.segments_from_position_ids
    monkeypatch.setattr(registration, "segments_from_position_ids",
                        lambda *a: reads.append(1) or original(*a))
    model = _model("neutrain_sage", layers=3)
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(4))
    _step(model, ids, position_ids=torch.arange(40)[None].expand(2, -1))
    assert len(reads) == 1  # three layers' forwards and their three recomputes: one read
    reads.clear()
    causal_lm_loss(model, ids, ids).backward()  # the decoder called without positions: contiguous, unread
    assert reads == []


def test_packed_rows_are_read_again_for_new_or_changed_positions(table_picks_sdpa, monkeypatch):
    reads = []
    original = registration.segments_from_position_ids
    monkeypatch.setattr(registration, "segments_from_position_ids",
                        lambda *a: reads.append(1) or original(*a))
    pos = torch.cat([torch.arange(20), torch.arange(12)])[None]
    first = registration.packed_segments(pos, 1, 32)
    assert first.tolist() == [[0] * 20 + [1] * 12] and registration.packed_segments(pos, 1, 32) is first
    pos[0, 20:] += 20  # one document now: the version counter moved, so the rows are read again
    assert registration.packed_segments(pos, 1, 32) is None
    assert registration.packed_segments(pos.clone(), 1, 32) is None  # another tensor: read again
    assert registration.packed_segments(pos, 2, 32) is None  # another batch: read again
    assert len(reads) == 4


def test_a_packed_batch_dispatched_to_sdpa_keeps_its_documents_apart(table_picks_sdpa):
    model = _model("neutrain_sage").eval()
    a, b = torch.randint(0, 97, (1, 20)), torch.randint(0, 97, (1, 28))
    pos = torch.cat([torch.arange(20), torch.arange(28)])[None]
    with torch.no_grad():
        packed = model(torch.cat([a, b], 1), position_ids=pos).logits[0]
        apart = torch.cat([model(a).logits[0], model(b).logits[0]])
    assert torch.allclose(packed, apart, atol=1e-5, rtol=1e-4)


def test_grouped_heads_dispatched_to_sdpa_are_expanded_without_the_modules_group_count(table_picks_sdpa):
    # transformers' sdpa expands grouped K/V heads only for a module with num_key_value_groups; a module
    # without it must still attend each query head to its own K/V head, not fail on the head count.
    module = torch.nn.Module()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 32, 64, generator=g) for h in (4, 2, 2))
    out, _ = registration.neutrain_sage_attention_forward(module, q, k, v, None, is_causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True).transpose(1, 2)
    assert out.shape == (1, 32, 4, 64) and torch.allclose(out, want, atol=1e-6, rtol=1e-5)
