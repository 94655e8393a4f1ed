"""Non-finite gradients, overflowing updates, tied weights and checkpoint round trips."""

import copy

import pytest
import torch

from neutrain.optim import LOMO, AdaLomo, AdamWInBackward

from .optim_helpers import batches, loss_fn, make_mlp, train_fused, train_reference


def test_nonfinite_gradient_skips_only_that_tensor(caplog):
    model = make_mlp()
    before = copy.deepcopy(model)
    opt = AdamWInBackward(model.parameters(), lr=1e-2).bind(model)
    handle = model[2].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([1]), float("nan")))
    with caplog.at_level("WARNING"):
        opt.backward(loss_fn(model, batches(1)[0]))
        opt.step()
    handle.remove()
    assert torch.equal(model[2].weight, before[2].weight)
    state = opt.state[model[2].weight]
    assert float(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    for name in ("0.weight", "0.bias", "2.bias", "4.weight"):
        assert not torch.equal(model.get_parameter(name), before.get_parameter(name)), name
    assert opt.nonfinite_skips == 1 and opt.last_skipped == ["2.weight"]
    assert "2.weight" in caplog.text
    assert opt.grad_norm() == pytest.approx(opt.grad_norm()) and torch.isfinite(opt.last_grad_norm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_overflowing_update_never_makes_weights_nonfinite(dtype):
    model = make_mlp(dtype)
    opt = LOMO(model.parameters(), lr=1e38).bind(model)
    for batch in batches(2, dtype):
        opt.backward(loss_fn(model, batch) * 1e3)
        opt.step()
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


class TiedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 6)
        self.mid = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def test_tied_dense_weight_updated_once_with_summed_gradient():
    ref = TiedLM()
    fused = copy.deepcopy(ref)
    assert fused.head.weight is fused.emb.weight
    ids = torch.randint(0, 10, (4, 7))
    calls = []
    opt = LOMO(fused.parameters(), lr=0.3).bind(fused)
    fused.emb.weight.register_post_accumulate_grad_hook(lambda p: calls.append(1))
    for _ in range(3):
        sgd = torch.optim.SGD(ref.parameters(), lr=0.3)
        sgd.zero_grad()
        torch.nn.functional.cross_entropy(ref(ids).flatten(0, 1), ids.flatten()).backward()
        sgd.step()
        opt.backward(torch.nn.functional.cross_entropy(fused(ids).flatten(0, 1), ids.flatten()))
        opt.step()
    assert len(calls) == 3
    for pa, pb in zip(ref.parameters(), fused.parameters()):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("cls", [AdaLomo, AdamWInBackward, LOMO])
def test_state_dict_round_trip_resumes_bit_exactly(cls):
    model = make_mlp(torch.bfloat16)
    data = batches(6, torch.bfloat16)
    opt = cls(model.parameters(), lr=1e-2, clip_mode="global_stale", max_grad_norm=0.5, seed=11)
    train_fused(model, opt, data[:3])
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    train_fused(model, opt, data[3:])

    resumed = make_mlp(torch.bfloat16, seed=123)
    resumed.load_state_dict(saved_model)
    opt2 = cls(resumed.parameters(), lr=1e-2, clip_mode="global_stale", max_grad_norm=0.5, seed=0)
    opt2.load_state_dict(saved_opt)
    assert opt2.steps_done == 3 and opt2.seed == 11
    for state in opt2.state.values():
        assert all(v.dtype == torch.float32 for v in state.values())
    train_fused(resumed, opt2, data[3:])
    for pa, pb in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(pa, pb)


def test_stochastic_rounding_keeps_small_updates_on_average():
    # lr * g is far below half an ulp of the weights: nearest rounding loses everything.
    w0 = torch.full((64, 64), 1.0, dtype=torch.bfloat16)
    grad = torch.full((64, 64), 1.0, dtype=torch.bfloat16)
    results = {}
    for sr in (False, True):
        w = torch.nn.Parameter(w0.clone())
        opt = LOMO([w], lr=2**-11, stochastic_rounding=sr)
        for _ in range(8):
            opt.update_(w, w.data, grad)
            opt.step()
        results[sr] = w.float().mean().item()
    assert results[False] == 1.0
    assert results[True] == pytest.approx(1.0 - 8 * 2**-11, abs=2e-4)


def test_zero_grad_is_safe_and_step_without_updates_is_harmless():
    model = make_mlp()
    opt = LOMO(model.parameters(), lr=0.1)
    model[0].weight.grad = torch.ones_like(model[0].weight)
    opt.zero_grad()
    assert model[0].weight.grad is None
    opt.step()
    assert opt.grad_norm() is None


def test_reference_training_helper_is_consistent():
    # Guards the helpers themselves: the fused loop must differ from no training at all.
    a, b = make_mlp(), make_mlp()
    train_reference(a, torch.optim.SGD(a.parameters(), lr=0.1), batches(2))
    train_fused(b, LOMO(b.parameters(), lr=0.1), batches(2))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a[0].weight, make_mlp()[0].weight)
