"""AdaLomo against a plain, whole-tensor reference written from the paper / lomo-optim semantics."""

import math

import torch

from neutrain.optim import AdaLomo

from .optim_helpers import batches, loss_fn, make_mlp, train_fused, twin


class ReferenceAdaLomo:
    """Straightforward AdaLomo over full gradients (lomo_optim.AdaLomo's arithmetic, no loss scale)."""

    def __init__(self, params, lr, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8, weight_decay=0.0):
        self.params = list(params)
        self.lr, self.eps, self.clip_threshold = lr, eps, clip_threshold
        self.decay_rate, self.weight_decay = decay_rate, weight_decay
        self.step_num = 0
        self.row, self.col, self.full = {}, {}, {}
        for i, p in enumerate(self.params):
            if p.dim() > 1:
                self.row[i] = torch.zeros(p.shape[0])
                self.col[i] = torch.zeros(p.shape[1])
            else:
                self.full[i] = torch.zeros(p.shape)

    @torch.no_grad()
    def step(self):
        self.step_num += 1
        beta = 1.0 - math.pow(self.step_num, self.decay_rate)
        for i, p in enumerate(self.params):
            g = p.grad.float()
            sq = g**2 + self.eps[0]
            if p.dim() > 1:
                self.row[i].mul_(beta).add_(sq.mean(dim=-1), alpha=1 - beta)
                self.col[i].mul_(beta).add_(sq.mean(dim=-2), alpha=1 - beta)
                r = (self.row[i] / self.row[i].mean()).rsqrt().unsqueeze(-1)
                c = self.col[i].unsqueeze(-2).rsqrt()
                update = r * c * g
            else:
                self.full[i].mul_(beta).add_(sq, alpha=1 - beta)
                update = self.full[i].rsqrt() * g
            rms = update.norm(2) / math.sqrt(update.numel())
            update = update / (rms / self.clip_threshold).clamp(min=1.0)
            p32 = p.float()
            lr = self.lr * max(self.eps[1], float(p32.norm(2) / math.sqrt(p.numel())))
            if self.weight_decay:
                p32 = p32 * (1 - lr * self.weight_decay)
            p.copy_(p32 - lr * update)


def _train_reference(model, opt, data):
    for batch in data:
        model.zero_grad()
        loss_fn(model, batch).backward()
        opt.step()


def test_adalomo_matches_reference():
    ref = make_mlp()
    fused = twin(ref)
    data = batches(8)
    _train_reference(ref, ReferenceAdaLomo(ref.parameters(), lr=1e-2, weight_decay=0.05), data)
    opt = AdaLomo(fused.parameters(), lr=1e-2, weight_decay=0.05)
    train_fused(fused, opt, data)
    start = make_mlp()
    for (name, pa), pb, p0 in zip(ref.named_parameters(), fused.parameters(), start.parameters()):
        torch.testing.assert_close(pb, pa, rtol=2e-5, atol=1e-6, msg=name)
        assert not torch.equal(pb, p0), name
    assert float(opt.state[fused[0].weight]["step"]) == 8


def test_adalomo_clip_threshold_engages():
    # A tiny clip threshold makes the grouped normalisation active on every tensor.
    ref = make_mlp()
    fused = twin(ref)
    data = batches(3)
    _train_reference(ref, ReferenceAdaLomo(ref.parameters(), lr=1e-2, clip_threshold=0.05), data)
    train_fused(fused, AdaLomo(fused.parameters(), lr=1e-2, clip_threshold=0.05), data)
    for pa, pb in zip(ref.parameters(), fused.parameters()):
        torch.testing.assert_close(pb, pa, rtol=2e-5, atol=1e-6)


def test_adalomo_chunked_matches_unchunked():
    a = make_mlp()
    b = twin(a)
    data = batches(4)
    train_fused(a, AdaLomo(a.parameters(), lr=1e-2), data)
    train_fused(b, AdaLomo(b.parameters(), lr=1e-2, chunk_numel=20), data)  # 1-2 rows per chunk
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-7)
