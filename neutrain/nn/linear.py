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

The input is saved by a node of its own, :class:`_SavedInput`, ahead of the product's
node, which reads it from there in backward. A custom function packs what it saves only
after its forward has run, so saving it in the product's node packed the input after the
product: the recompute's early stop (it stops at the last tensor backward needs, raised
from that tensor's pack) then came after the layer's last product, ``down_proj``'s, which
the recompute ran for nothing (one decoder-layer-sized product per layer a step, about
40 ms of Llama-3-8B's batch-8 step on an H200). A native ``mm`` saves its inputs before it
runs, so dense never ran it. Saved ahead, the recompute stops where dense's does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from neutrain.compat.autograd import in_checkpointed_region
from neutrain.nn.prefetch import PREFETCHER
from neutrain.nn.state import CompressedModuleMixin
from neutrain.nn.weight import CompressedWeight


class _SavedInput(torch.autograd.Function):
    """Identity on the input that saves it for the product's backward, packed before the product runs.

    ``key`` is the weight's gradient key: it makes the output require grad, so this node exists (and saves
    ``x``) even where ``x`` itself needs no gradient, as the first layer's input."""

    @staticmethod
    def forward(ctx, x, key):
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CompressedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key, bias, weight: CompressedWeight, grad_enabled: bool, saved, x_needs_grad: bool):
        w = weight.decode_for_compute()
        PREFETCHER.after_decode(weight, grad_enabled)  # grad mode is off inside Function.forward
        x2 = x.reshape(-1, x.shape[-1])
        # addmm with the bias, as F.linear does for flattened inputs (same rounding as nn.Linear).
        out = torch.addmm(bias, x2, w.t()) if bias is not None else x2.mm(w.t())
        ctx.saved = saved  # the _SavedInput node holding x (None: no backward will need x)
        ctx.x_shape = x.shape
        ctx.x_needs_grad = x_needs_grad
        ctx.weight = weight
        ctx.has_bias = bias is not None
        return out.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        weight: CompressedWeight = ctx.weight
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        need_x = ctx.x_needs_grad and ctx.needs_input_grad[0]
        grad_x = grad_bias = x = None
        if ctx.needs_input_grad[1]:
            # Unpacked first: under checkpointing this runs the recompute, whose decodes would otherwise
            # take this weight's slot between its decode here and the update's read (a second decode).
            (x,) = ctx.saved.saved_tensors
        if need_x or ctx.needs_input_grad[1]:
            w = weight.decode_for_compute()
            PREFETCHER.after_decode(weight, True)
            grad_x = g2.mm(w).view(ctx.x_shape) if need_x else None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = g2.sum(0)
        if ctx.needs_input_grad[1]:
            # Same product as autograd's mm backward for weight.t(): grad.t() @ input.
            grad_w = g2.t().mm(x.reshape(-1, x.shape[-1]))
            weight.apply_grad(grad_w)
        return grad_x, None, grad_bias, None, None, None, None


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
        grad_enabled = torch.is_grad_enabled()
        weight = self.compressed
        group = weight.group
        if group is not None and group.native and weight.compute_dtype == weight.dtype and (
                not grad_enabled or in_checkpointed_region()):
            # The layer's matrices sit decoded in its group's buffer: the native product, as nn.Linear runs it
            # (the gradient reaches the fused update through the leaf's hook: neutrain.nn.groups.WeightGroup.leaf).
            return F.linear(x, group.leaf(weight) if grad_enabled else group.view(weight), self.bias)
        saved = None
        if grad_enabled and self.weight_key.requires_grad:  # the weight gradient needs x: saved before the product
            x_needs_grad = x.requires_grad
            x = _SavedInput.apply(x, self.weight_key)
            saved = x.grad_fn
        else:
            x_needs_grad = True
        return _CompressedLinearFunction.apply(x, self.weight_key, self.bias, self.compressed, grad_enabled, saved,
                                               x_needs_grad)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self.compressed._ct!r}")
