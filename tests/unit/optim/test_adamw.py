"""AdamWInBackward against torch.optim.AdamW."""

import torch

from neutrain.optim import AdamWInBackward

from .optim_helpers import batches, make_mlp, train_fused, train_reference, twin


def test_adamw_in_backward_matches_torch_adamw():
    ref = make_mlp()
    fused = twin(ref)
    data = batches(6)
    kw = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1)
    train_reference(ref, torch.optim.AdamW(ref.parameters(), foreach=False, **kw), data)
    opt = AdamWInBackward(fused.parameters(), **kw)
    train_fused(fused, opt, data)
    for (name, pa), pb in zip(ref.named_parameters(), fused.parameters()):
        torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-7, msg=name)
    state = opt.state[fused[0].weight]
    assert state["exp_avg"].dtype == torch.float32 and float(state["step"]) == 6
