"""Small models and a training loop shared by the optimizer tests."""

import copy


import torch


def make_mlp(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 12), torch.nn.Tanh(), torch.nn.Linear(12, 4)
    ).to(dtype)


def batches(n, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 8, generator=g).to(dtype), torch.randn(5, 4, generator=g).to(dtype)) for _ in range(n)]


def loss_fn(model, batch):
    x, y = batch
    return (model(x).float() - y.float()).square().mean()


def train_reference(model, opt, data, scheduler=None, before_step=None):
    """Ordinary training: full gradients, then opt.step()."""
    for batch in data:
        opt.zero_grad()
        loss_fn(model, batch).backward()
        if before_step is not None:
            before_step(model)
        opt.step()
        if scheduler is not None:
            scheduler.step()


def train_fused(model, opt, data, scheduler=None):
    """Fused training: updates inside backward, step() for bookkeeping."""
    opt.bind(model)
    for batch in data:
        opt.backward(loss_fn(model, batch))
        opt.step()
        if scheduler is not None:
            scheduler.step()
        assert all(p.grad is None for p in model.parameters())


def twin(model):
    return copy.deepcopy(model)


