"""Gradient accumulation: the update runs once per step with the summed micro-batch gradients."""

import pytest
import torch

from neutrain.optim import LOMO, AdaLomo

from .optim_helpers import batches, loss_fn, make_mlp, twin


def test_accumulated_lomo_equals_sgd_on_summed_gradients():
    ref = make_mlp()
    fused = twin(ref)
    data = batches(6)
    sgd = torch.optim.SGD(ref.parameters(), lr=0.05)
    for i in range(0, 6, 3):
        sgd.zero_grad()
        for batch in data[i : i + 3]:
            loss_fn(ref, batch).backward()
        sgd.step()
    opt = LOMO(fused.parameters(), lr=0.05, gradient_accumulation_steps=3, clip_mode="global_exact",
               max_grad_norm=1e9).bind(fused)
    start = [p.detach().clone() for p in fused.parameters()]
    for i, batch in enumerate(data):
        opt.backward(loss_fn(fused, batch))
        if i % 3 < 2:  # early micro-batches leave the weights alone
            assert all(torch.equal(p, s) for p, s in zip(fused.parameters(), start))
        else:
            opt.step()
            start = [p.detach().clone() for p in fused.parameters()]
    for pa, pb in zip(ref.parameters(), fused.parameters()):
        assert torch.equal(pa, pb)
    assert not opt.accumulation.sums


@pytest.mark.parametrize("clip", [None, 0.05])
def test_short_last_window_applies_the_partial_sum_once(clip):
    # An epoch of 5 batches with accumulation 3: Hugging Face steps after 3, then after 2.
    ref = make_mlp()
    fused = twin(ref)
    data = batches(5)
    sgd = torch.optim.SGD(ref.parameters(), lr=0.05)
    for window in (data[:3], data[3:]):
        sgd.zero_grad()
        for batch in window:
            loss_fn(ref, batch).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        sgd.step()
    opt = LOMO(fused.parameters(), lr=0.05, gradient_accumulation_steps=3, clip_mode="global_exact",
               max_grad_norm=clip).bind(fused)
    for window in (data[:3], data[3:]):
        for batch in window:
            opt.backward(loss_fn(fused, batch))
        opt.step()
    for pa, pb in zip(ref.parameters(), fused.parameters()):
        if clip:
            torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-7)
        else:
            assert torch.equal(pa, pb)
    assert opt.grad_norm() > 0 and not opt.accumulation.sums


def test_accumulation_misuse_is_refused():
    model = make_mlp()
    opt = AdaLomo(model.parameters(), lr=1e-2, gradient_accumulation_steps=2).bind(model)
    with pytest.raises(RuntimeError, match="optimizer.backward"):
        loss_fn(model, batches(1)[0]).backward()
    opt.backward(loss_fn(model, batches(1)[0]))
    opt.backward(loss_fn(model, batches(1)[0]))
    with pytest.raises(RuntimeError, match="since the last optimizer.step"):
        opt.backward(loss_fn(model, batches(1)[0]))
    with pytest.raises(ValueError, match=">= 1"):
        LOMO(model.parameters(), lr=0.1, gradient_accumulation_steps=0)
