"""Exact causal attention over packed rows, one document at a time (``neutrain.attention.per_document``): the
same values and gradients as the block-diagonal masked SDPA it replaces, on generated layouts, called directly, by
``neutrain_sdpa`` and by the calls ``neutrain_sage`` gives to SDPA; on a GPU, the one-launch variable-length path
too, and its backward bit for bit twice under ``train.deterministic``."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from neutrain.attention.counters import counters, reset_counters
from neutrain.attention.per_document import packed_causal_attention, varlen_available
from neutrain.attention.registration import _fallback_mask

HEADS, KV_HEADS, DIM = 4, 2, 16


def _segments(lengths_per_row: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(row)])
                        for row in lengths_per_row])


def _masked(q, k, v, segments):
    """The reference: SDPA with the block-diagonal causal mask transformers' ``sdpa`` path builds."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    n = q.shape[2]
    mask = _fallback_mask(n, n, True, None, segments.to(q.device), None, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def _inputs(segments: torch.Tensor, dim: int) -> tuple[torch.Tensor, ...]:
    """Query, key and value in float64 (grouped heads), recording gradients."""
    batch, n = segments.shape
    return tuple(torch.randn(batch, heads, n, dim, dtype=torch.float64, requires_grad=True)
                 for heads in (HEADS, KV_HEADS, KV_HEADS))


def _assert_equals_the_masked_attention(out, q, k, v, segments):
    """``out`` has the masked attention's values, and the same gradients for one upstream gradient."""
    ref = _masked(q, k, v, segments)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@st.composite
def layouts(draw):
    n = draw(st.integers(min_value=1, max_value=48))
    rows = draw(st.integers(min_value=1, max_value=3))
    out = []
    for _ in range(rows):
        cuts = sorted(draw(st.sets(st.integers(min_value=1, max_value=n - 1), max_size=6))) if n > 1 else []
        bounds = [0, *cuts, n]
        out.append([b - a for a, b in zip(bounds[:-1], bounds[1:])])
    return out


@settings(max_examples=40, deadline=None)
@given(layout=layouts(), seed=st.integers(0, 2**16))
def test_packed_attention_equals_the_masked_attention_with_its_gradients(layout, seed):
    torch.manual_seed(seed)
    segments = _segments(layout)
    q, k, v = _inputs(segments, DIM)
    _assert_equals_the_masked_attention(packed_causal_attention(q, k, v, segments), q, k, v, segments)


def test_a_model_with_neutrain_sdpa_trains_packed_rows_as_sdpa_does():
    from transformers import AutoModelForCausalLM, LlamaConfig

    from neutrain.attention.packed import register

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97)
    torch.manual_seed(0)
    ids = torch.randint(0, 97, (2, 24))
    positions = torch.tensor([list(range(10)) + list(range(14)), list(range(5)) + list(range(12)) + list(range(7))])
    grads, losses = {}, {}
    for name in ("sdpa", register()):
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name, dtype=torch.float64)
        reset_counters()
        loss = model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False).loss  # training: no cache
        loss.backward()
        losses[name], grads[name] = loss.detach(), [p.grad for p in model.parameters()]
        if name != "sdpa":
            assert counters["packed_documents"] == 2 * 5  # two layers, five documents: no masked call
    torch.testing.assert_close(losses["neutrain_sdpa"], losses["sdpa"])
    for a, b in zip(grads["neutrain_sdpa"], grads["sdpa"]):
        torch.testing.assert_close(a, b)


def test_the_recipe_takes_neutrain_sdpa(tmp_path):
    from neutrain.config import load_recipe

    recipe = load_recipe("default", ["model.attn_implementation=neutrain_sdpa", f"train.output_dir={tmp_path}"])
    assert recipe.model.attn_implementation == "neutrain_sdpa"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the device machine")
@pytest.mark.parametrize("deterministic", [False, True])
def test_the_one_launch_path_on_a_gpu_matches_and_repeats_under_deterministic_kernels(deterministic):
    from neutrain.trainer.determinism import deterministic_kernels

    torch.manual_seed(0)
    layout = [[700, 1300, 48], [2048]]
    segments = _segments(layout).cuda()
    q = torch.randn(2, 8, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 2, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 2, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert varlen_available(q)
    reset_counters()
    with deterministic_kernels(deterministic):
        out = packed_causal_attention(q, k, v, segments)
        grad = torch.randn_like(out)
        first = torch.autograd.grad(out, (q, k, v), grad)
        second = torch.autograd.grad(packed_causal_attention(q, k, v, segments), (q, k, v), grad)
    assert counters["packed_varlen"] == 2
    ref = _masked(q.float(), k.float(), v.float(), segments)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    if deterministic:
        for a, b in zip(first, second):
            assert torch.equal(a, b)


class _CausalModule(torch.nn.Module):
    is_causal = True


def _positions(layout: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in layout])


@pytest.mark.parametrize("route", ["unsupported head size", "dispatched to sdpa"])
@settings(max_examples=20, deadline=None)
@given(layout=layouts(), seed=st.integers(0, 2**16))
def test_neutrain_sage_runs_the_packed_rows_it_sends_to_sdpa_one_document_at_a_time(route, layout, seed):
    # The calls neutrain_sage gives to SDPA (a head size Sage lacks; on a GPU, a shape the dispatch table
    # measured faster under SDPA) take the per-document path for packed rows, not the block-diagonal mask.
    from neutrain.attention import registration

    dim = DIM if route == "unsupported head size" else 64
    torch.manual_seed(seed)
    segments, positions = _segments(layout), _positions(layout)
    q, k, v = _inputs(segments, dim)
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        if route == "dispatched to sdpa":
            mp.setattr(registration, "dispatch_device", lambda query: "a GPU the table has not measured")
            mp.delenv("NEUTRAIN_SAGE_DISPATCH", raising=False)
        original = registration.packed_causal_attention
        mp.setattr(registration, "packed_causal_attention", lambda *a: calls.append(1) or original(*a))
        out, _ = registration.neutrain_sage_attention_forward(_CausalModule(), q, k, v, None, position_ids=positions)
    assert len(calls) == (1 if any(len(row) > 1 for row in layout) else 0)  # unpacked rows: no documents to split
    _assert_equals_the_masked_attention(out, q, k, v, segments)
