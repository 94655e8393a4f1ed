"""Fused LOMO equals plain SGD on the same gradients; schedulers act live."""

import pytest
import torch

from neutrain.optim import LOMO

from .optim_helpers import batches, loss_fn, make_mlp, train_fused, train_reference, twin


def _assert_same(a, b):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name


def test_lomo_equals_sgd_fp32_bitwise():
    ref = make_mlp()
    fused = twin(ref)
    data = batches(6)
    train_reference(ref, torch.optim.SGD(ref.parameters(), lr=0.05), data)
    train_fused(fused, LOMO(fused.parameters(), lr=0.05), data)
    _assert_same(ref, fused)
    assert not torch.equal(ref[0].weight, make_mlp()[0].weight), "training must move the weights"


def test_lomo_weight_decay_matches_sgd():
    ref = make_mlp()
    fused = twin(ref)
    data = batches(4)
    # SGD's coupled L2 decay equals LOMO's decoupled decay for plain SGD: w(1 - lr wd) - lr g.
    train_reference(ref, torch.optim.SGD(ref.parameters(), lr=0.05, weight_decay=0.1), data)
    train_fused(fused, LOMO(fused.parameters(), lr=0.05, weight_decay=0.1), data)
    for pa, pb in zip(ref.parameters(), fused.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)


def test_lomo_bf16_nearest_rounding_matches_fp32_arithmetic():
    model = make_mlp(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {}
    model.zero_grad()
    loss_fn(model, batches(1, torch.bfloat16)[0]).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    fused = twin(model)
    for p in fused.parameters():
        p.grad = None
    opt = LOMO(fused.parameters(), lr=0.5, stochastic_rounding=False).bind(fused)
    opt.backward(loss_fn(fused, batches(1, torch.bfloat16)[0]))
    opt.step()
    for n, p in fused.named_parameters():
        expected = (before[n].float() - 0.5 * grads[n].float()).to(torch.bfloat16)
        assert torch.equal(p.detach(), expected), n


def test_scheduler_lr_is_read_live():
    ref = make_mlp()
    fused = twin(ref)
    data = batches(5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    fused_opt = LOMO(fused.parameters(), lr=0.1)
    halve = lambda step: 0.5**step  # noqa: E731
    train_reference(ref, ref_opt, data, torch.optim.lr_scheduler.LambdaLR(ref_opt, halve))
    train_fused(fused, fused_opt, data, torch.optim.lr_scheduler.LambdaLR(fused_opt, halve))
    _assert_same(ref, fused)
    assert fused_opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**5)


def test_chunked_update_equals_whole_tensor_update():
    a, b = make_mlp(torch.bfloat16), make_mlp(torch.bfloat16)
    data = batches(3, torch.bfloat16)
    train_fused(a, LOMO(a.parameters(), lr=0.05, seed=3), data)
    train_fused(b, LOMO(b.parameters(), lr=0.05, seed=3, chunk_numel=16), data)
    _assert_same(a, b)


def test_refuses_fp16():
    with pytest.raises(ValueError, match="fp16"):
        LOMO(make_mlp(torch.float16).parameters(), lr=0.1)


def test_build_fused_optimizer_groups_and_binds():
    from neutrain.optim import AdaLomo, build_fused_optimizer

    model = make_mlp()
    model[2].requires_grad_(False)
    opt = build_fused_optimizer(model, "adalomo", lr=1e-2, weight_decay=0.1)
    assert isinstance(opt, AdaLomo)
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and all(p.dim() == 2 for p in decayed["params"])
    assert plain["weight_decay"] == 0.0 and all(p.dim() == 1 for p in plain["params"])
    assert len(opt.hooks.handles) == 4  # frozen layer excluded
    frozen = model[2].weight.detach().clone()
    opt.backward(loss_fn(model, batches(1)[0]))
    opt.step()
    assert torch.equal(model[2].weight, frozen) and model[2].weight.grad is None
    with pytest.raises(ValueError, match="unknown fused optimizer"):
        build_fused_optimizer(model, "sgdx", lr=0.1)
