"""``CompressedLinear``: a linear layer whose weight stays compressed (NeuZip Algorithm 1).

Forward decodes the weight into the shared decode buffer and multiplies; only
the input is saved. Backward decodes again, computes the input gradient, then
the weight gradient, and hands the latter straight to the fused optimizer,
which updates the decoded weight in place and re-encodes it. The weight
gradient is never stored as ``.grad`` and no decoded weight outlives the call.

The matrix products are exactly the ones autograd runs for ``nn.Linear`` on a
contiguous input (``mm`` / ``addmm`` on the flattened tokens), so a compressed
model computes bit-identical gradients to its dense twin. With a compute dtype
wider than the stored one (fp32 over bf16 on CPU) the products run on the
upcast weight, as ``nn.Linear`` would with that weight in fp32.

On CUDA the next weight can be decoded on a side stream meanwhile
(:mod:`neutrain.nn.prefetch`, opt-in): each decode request, forward, recompute
or backward, is reported to the prefetcher, which records their order.

Activation checkpointing (``torch.utils.checkpoint``, non-reentrant) composes:
the recompute calls forward again, which decodes again (or, within the keep
budget, finds the forward's decode still current: :mod:`neutrain.nn.buffers`);
nothing decoded is saved by autograd for backward.
"""

from __future__ import annotations

import torch

from neutrain.nn.prefetch import PREFETCHER
from neutrain.nn.state import CompressedModuleMixin
from neutrain.nn.weight import CompressedWeight


class _CompressedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key, bias, weight: CompressedWeight, grad_enabled: bool):
        w = weight.decode_for_compute()
        PREFETCHER.after_decode(weight, grad_enabled)  # grad mode is off inside Function.forward
        x2 = x.reshape(-1, x.shape[-1])
        # addmm with the bias, as F.linear does for flattened inputs (same rounding as nn.Linear).
        out = torch.addmm(bias, x2, w.t()) if bias is not None else x2.mm(w.t())
        ctx.save_for_backward(x)
        ctx.weight = weight
        ctx.has_bias = bias is not None
        return out.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        weight: CompressedWeight = ctx.weight
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        w = weight.decode_for_compute()
        PREFETCHER.after_decode(weight, True)
        grad_x = g2.mm(w).view(x.shape) if ctx.needs_input_grad[0] else None
        grad_bias = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if ctx.needs_input_grad[1]:
            # Same product as autograd's mm backward for weight.t(): grad.t() @ input.
            grad_w = g2.t().mm(x.reshape(-1, x.shape[-1]))
            weight.apply_grad(grad_w)
        return grad_x, None, grad_bias, None, None


class CompressedLinear(CompressedModuleMixin, torch.nn.Module):
    """``y = x W^T + b`` with ``W`` compressed; trained by a fused optimizer.

    Args:
        weight: the :class:`CompressedWeight` (shared with a tied embedding, if any).
        bias: optional dense bias parameter (kept dense, updated by the optimizer's hook).

    Example:
        >>> from neutrain.compress import compress
        >>> dense = torch.nn.Linear(8, 4, bias=False).bfloat16()
        >>> layer = CompressedLinear(CompressedWeight(compress(dense.weight.detach())))
        >>> x = torch.randn(2, 8).bfloat16()
        >>> torch.equal(layer(x), dense(x))
        True
    """

    def __init__(self, weight: CompressedWeight, bias: torch.nn.Parameter | None = None):
        super().__init__()
        self.compressed = weight
        self.out_features, self.in_features = weight.shape
        self.weight_key = weight.key
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _CompressedLinearFunction.apply(x, self.weight_key, self.bias, self.compressed, torch.is_grad_enabled())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self.compressed.ct!r}")
