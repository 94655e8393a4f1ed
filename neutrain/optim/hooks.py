"""Wiring a fused optimizer into backward: where each gradient comes from, and when it is applied.

Two ways a gradient reaches the optimizer, one code path:

* dense trainable parameters: a ``register_post_accumulate_grad_hook`` (fires
  once per backward, after all contributions, tied uses included, are summed
  into ``.grad``); a shard's gradient is first cut to this rank's slice
  (:class:`~neutrain.optim.sharding.ShardMap`);
* compressed weights (``neutrain.nn``) never get a ``.grad``: their backward
  hands the gradient over with a weight I/O object that decodes the weight and
  re-encodes it after the update.

A compressed weight used by two modules (tied embedding and lm_head) gets one
contribution per use: those are summed and applied once, at the end of backward.
"""

from __future__ import annotations

from typing import Callable

import torch

from neutrain.compat.autograd import in_backward
from neutrain.optim.weight_io import COMPRESSED_KEY_ATTR, DenseWeightIO, WeightIO



class BackwardHooks:
    """The hooks, parameter names and tied-weight deferral of one fused optimizer.

    Args:
        optimizer: the optimizer the gradients go to (its ``consume_grad_``).

    Example:
        >>> from neutrain.optim import LOMO
        >>> model = torch.nn.Linear(2, 2)
        >>> opt = LOMO(model.parameters(), lr=0.1).bind(model)
        >>> len(opt.hooks.handles), opt.hooks.name_of(model.bias)
        (2, 'bias')
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.handles: list = []
        self.names: dict[torch.Tensor, str] = {}
        self.tied: set[torch.Tensor] = set()
        self._tied_pending: dict[torch.Tensor, list] = {}
        self._callback_queued = False

    def bind(self, model: torch.nn.Module, params: dict, before_hooks: Callable[[], None]) -> None:
        """Hook every dense trainable parameter of ``params`` and hand the optimizer to compressed modules.

        ``before_hooks`` runs once the tied weights are known, before any hook is registered.
        """
        self.unbind()
        opt = self.optimizer
        self.names = {p: n for n, p in model.named_parameters(remove_duplicate=False)}
        users: dict[torch.Tensor, int] = {}
        for module in model.modules():
            if hasattr(module, "bind_fused_optimizer"):
                for key in module.bind_fused_optimizer(opt):
                    users[key] = users.get(key, 0) + 1
        self.tied = {key for key, count in users.items() if count > 1}
        before_hooks()
        for p in params:
            if p.requires_grad and not getattr(p, COMPRESSED_KEY_ATTR, False):
                self.handles.append(p.register_post_accumulate_grad_hook(self._dense_hook))

    def unbind(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def name_of(self, key: torch.Tensor) -> str:
        """The parameter's name in the bound model, or ``param#<index>``."""
        return self.names.get(key, f"param#{self.optimizer._index_of[key]}")

    def _dense_hook(self, param: torch.Tensor) -> None:
        grad, param.grad = param.grad, None
        if grad is not None:
            opt = self.optimizer
            with torch.no_grad():
                # FSDP2 / ZeRO-3: update this rank's shard
                if not opt.shards.route(param, grad, opt.partition_sync, opt.consume_grad_):
                    opt.consume_grad_(param, grad, DenseWeightIO(param))

    def defer_tied(self, key: torch.Tensor, grad: torch.Tensor, io: WeightIO) -> bool:
        """Sum a tied weight's contribution for the end of backward; False if ``key`` is applied now.

        Inside backward only: outside it there is no end to wait for.
        """
        if key not in self.tied or not in_backward():
            return False
        pending = self._tied_pending.get(key)
        if pending is None:
            self._tied_pending[key] = [grad, io]
        else:
            pending[0] = pending[0] + grad
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
        return True

    def flush(self) -> None:
        """Apply the summed tied-weight gradients (queued at the end of backward; also run by step())."""
        self._callback_queued = False
        pending, self._tied_pending = self._tied_pending, {}
        opt = self.optimizer
        with torch.no_grad():
            for key, (grad, io) in pending.items():
                opt._consume_now(key, grad, io)
            if opt.grad_sync is not None:
                opt.grad_sync.drain()

    @property
    def pending(self) -> bool:
        """Whether tied-weight gradients wait to be applied."""
        return bool(self._tied_pending)
