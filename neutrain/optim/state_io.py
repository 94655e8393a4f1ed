"""A fused optimizer's state round-trip: torch's optimizer state plus the fused bookkeeping.

Two things differ from ``torch.optim.Optimizer``'s own round-trip: the fused
bookkeeping (step count, non-finite skips, rounding seed, last gradient norm)
travels in a ``"fused"`` entry, and loaded state keeps its dtype (torch casts
it to each parameter's dtype; fused state is fp32 by design, as bf16 second
moments underflow).
"""

from __future__ import annotations

import copy
import torch

from neutrain.optim.rounding import SeededGenerators


FUSED_KEY = "fused"


def bookkeeping(opt: torch.optim.Optimizer) -> dict:
    """The fused entry of a state dict (plain numbers: JSON-safe).

    Example:
        >>> from neutrain.optim import LOMO
        >>> bookkeeping(LOMO([torch.nn.Parameter(torch.zeros(1))], seed=3))
        {'steps_done': 0, 'nonfinite_skips': 0, 'seed': 3, 'prev_grad_norm': None}
    """
    prev = opt.stats.prev_grad_norm
    return {
        "steps_done": opt.steps_done,
        "nonfinite_skips": opt.stats.nonfinite_skips,
        "seed": opt.seed,
        "prev_grad_norm": None if prev is None else float(prev),
    }


def reload_keeping_dtypes(opt: torch.optim.Optimizer, state_dict: dict) -> None:
    """Replace the state torch loaded (cast to each parameter's dtype) by the saved one, moved to its device."""
    params = [p for group in opt.param_groups for p in group["params"]]
    saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
    for saved_id, param in zip(saved_ids, params):
        saved = state_dict["state"].get(saved_id)
        if saved is not None:
            opt.state[param] = {
                k: v.to(param.device, copy=True) if torch.is_tensor(v) else copy.deepcopy(v)
                for k, v in saved.items()
            }


def restore_bookkeeping(opt: torch.optim.Optimizer, fused: dict) -> None:
    """Inverse of :func:`bookkeeping`."""
    opt.steps_done = int(fused["steps_done"])
    opt.stats.nonfinite_skips = int(fused["nonfinite_skips"])
    opt.seed = int(fused["seed"])
    opt._generators = SeededGenerators(opt.seed)
    prev = fused["prev_grad_norm"]
    opt.stats.prev_grad_norm = None if prev is None else torch.tensor(prev, dtype=torch.float32)
