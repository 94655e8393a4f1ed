"""Sequence-chunked gated MLP: its ``tokens x intermediate`` intermediates exist one chunk of tokens at a time.

Why: in a checkpointed decoder layer's backward the MLP's intermediates (gate, up, ``act(gate) * up``) and
their gradients are the largest tensors alive, six ``tokens x intermediate`` blocks: 5.25 GiB for
Llama-3-70B at 16K tokens, more than a 12 GB card has left beside the weights. Each token's MLP output
depends on that token alone, so the same products over row chunks of the flattened tokens give the same
result: forward, the input gradient and, summed over the chunks, the weight gradients.

:class:`_ChunkedMLPFunction` saves only the MLP's input, through a node of its own ahead of the function (as
:class:`neutrain.nn.linear._SavedInput` does, for the same reason: a checkpoint's recompute then stops at that
input and never runs the MLP's products, which the backward runs chunk by chunk anyway). Backward runs each
chunk's gate and up products again, its backward, and adds the chunk's weight gradients into one gradient per
matrix (in the weights' compute dtype, as autograd's own product would give it, with ``addmm_``: no partial
product materialises). Only after the last chunk does each matrix's whole gradient go to its update: a dense
weight's through autograd (its ``.grad`` or a fused optimizer's post-accumulate hook, once a step), a NeuZip
weight's to its fused update (:meth:`~neutrain.nn.weight.CompressedWeight.apply_grad`); every chunk's
products read the weights before any update.

Down's gradient needs only the chunks' activations, gate's and up's need down's weight (through the
activation's gradient). So where down is a NeuZip weight decoded into a shared slot (the GPU's case), the backward
runs the chunks twice: the first pass sums down's gradient alone and hands it to its update, the second sums gate's
and up's (and the input's gradient). At most two weight gradients exist at once, not three: 0.44 GiB less for
Llama-3-70B, which is what brings its 16K step under a 12 GB card's 11 GiB. The second pass reads down's weight as
it was decoded before the update (the held slot keeps those values: the update decodes afresh into an
alternating slot) and computes gate and up again, a third more of the MLP's backward products. Each matrix's
gradient has the bits the one-pass backward gives it (the same products summed in the same order); down is updated
first, as autograd orders the unchunked MLP's updates.

The cost is memory for the matrices' gradients at once (the unchunked backward hands each to its update before
the next exists) and smaller products: :mod:`neutrain.memory.step_time` predicts it.

Example:
    >>> import torch
    >>> from transformers import LlamaConfig
    >>> from transformers.models.llama.modeling_llama import LlamaMLP
    >>> mlp = LlamaMLP(LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1))
    >>> x = torch.randn(2, 5, 8)
    >>> want = mlp(x)
    >>> chunk_mlps(mlp, 3)
    1
    >>> torch.allclose(mlp(x), want, atol=1e-6)
    True
"""

from __future__ import annotations

import torch

from neutrain.nn.buffers import DECODE_BUFFERS, HELD_SLOT
from neutrain.nn.linear import CompressedLinear

_ORIGINAL_FORWARD = "_neutrain_unchunked_forward"


class _SavedMLPInput(torch.autograd.Function):
    """Identity on the MLP's input that saves it for the chunked backward, packed before the MLP runs."""

    @staticmethod
    def forward(ctx, x, *keys):
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad,) + (None,) * (len(ctx.needs_input_grad) - 1)


def _weights(projs) -> list[torch.Tensor]:
    """The three projections' weights as the products read them (NeuZip weights decoded for compute).

    All three are read chunk after chunk, so all three decodes must stay valid together: gate and up take the
    two alternating decode slots, down the held slot (a third decode into an alternating slot would overwrite
    gate's while the chunks still read it). They are not shown to the prefetcher: a decode ahead goes into the
    less recently used alternating slot, which holds gate's weight until the last chunk.
    """
    out = []
    for proj, slot in zip(projs, (None, None, HELD_SLOT)):
        out.append(proj.compressed.decode_for_compute(slot) if isinstance(proj, CompressedLinear) else proj.weight)
    return out


def _grad_input(proj) -> torch.Tensor:
    """The tensor autograd routes the projection's weight gradient through (a NeuZip weight's gradient key)."""
    return proj.weight_key if isinstance(proj, CompressedLinear) else proj.weight


def _forward_rows(mlp, x2: torch.Tensor, ws, chunk: int) -> torch.Tensor:
    wg, wu, wd = ws
    out = x2.new_empty(x2.shape[0], wd.shape[0])
    for start in range(0, x2.shape[0], chunk):
        rows = x2[start:start + chunk]
        h = mlp.act_fn(rows.mm(wg.t())) * rows.mm(wu.t())
        torch.mm(h, wd.t(), out=out[start:start + chunk])
    return out


class _ChunkedMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, saved, mlp, chunk: int, *grad_inputs):
        ctx.saved, ctx.mlp, ctx.chunk, ctx.x_shape = saved, mlp, chunk, x.shape
        projs = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        ws = _weights(projs)
        out = _forward_rows(mlp, x.reshape(-1, x.shape[-1]), ws, chunk)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        mlp, chunk = ctx.mlp, ctx.chunk
        (x,) = ctx.saved.saved_tensors  # under checkpointing, this runs the layer's recompute up to here
        projs = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        ws = _weights(projs)
        x2 = x.reshape(-1, x.shape[-1])
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        need_x = ctx.needs_input_grad[0]
        trained = [ctx.needs_input_grad[4 + k] for k in range(3)]
        returned = [None, None, None]
        if trained[2] and two_pass(projs[2]):
            down = projs[2].compressed
            grad_down = torch.zeros(ws[2].shape, dtype=ws[2].dtype, device=ws[2].device)
            _chunk_passes(mlp, x2, g2, ws, chunk, grads=[None, None, grad_down], grad_x=None)
            # The update must not write into the held slot, whose values the second pass still reads: untagged,
            # its read decodes afresh into an alternating slot (gate's or up's, decoded again below).
            DECODE_BUFFERS.invalidate(down)
            down.apply_grad(grad_down)
            del grad_down
            ws = _weights(projs[:2]) + [ws[2]]
            trained[2] = False
        grad_x = torch.empty_like(x2) if need_x else None
        grads = [torch.zeros(w.shape, dtype=w.dtype, device=w.device) if t else None for w, t in zip(ws, trained)]
        _chunk_passes(mlp, x2, g2, ws, chunk, grads, grad_x)
        for k, (proj, grad) in enumerate(zip(projs, grads)):
            if grad is None:
                continue
            if isinstance(proj, CompressedLinear):
                proj.compressed.apply_grad(grad)  # every chunk's products are done: the update may write
            else:
                returned[k] = grad.to(proj.weight.dtype)
        grad_x = grad_x.view(ctx.x_shape) if need_x else None
        return (grad_x, None, None, None, *returned)


def _chunk_passes(mlp, x2, g2, ws, chunk: int, grads: list, grad_x) -> None:
    """One pass over the row chunks: sums the weight gradients ``grads`` asks for (None: not this pass) and
    writes the input's gradient into ``grad_x`` (None: not this pass)."""
    wg, wu, wd = ws
    need_act_grad = grad_x is not None or grads[0] is not None or grads[1] is not None
    for start in range(0, x2.shape[0], chunk):
        rows, dy = x2[start:start + chunk], g2[start:start + chunk]
        gate, up = rows.mm(wg.t()), rows.mm(wu.t())
        if not need_act_grad:  # down's gradient alone: the activation's product, no graph
            grads[2].addmm_(dy.t(), mlp.act_fn(gate) * up)
            continue
        with torch.enable_grad():  # the activation's backward as autograd runs it for the unchunked layer
            gate.requires_grad_(True)
            up.requires_grad_(True)
            h = mlp.act_fn(gate) * up
        if grads[2] is not None:
            grads[2].addmm_(dy.t(), h.detach())
        d_gate, d_up = torch.autograd.grad(h, (gate, up), dy.mm(wd))
        del h, gate, up
        if grad_x is not None:
            torch.mm(d_gate, wg, out=grad_x[start:start + chunk])
            grad_x[start:start + chunk].addmm_(d_up, wu)
        if grads[0] is not None:
            grads[0].addmm_(d_gate.t(), rows)
        if grads[1] is not None:
            grads[1].addmm_(d_up.t(), rows)
        del d_gate, d_up


def two_pass(down) -> bool:
    """Whether the chunked backward hands down's gradient to its update before gate's and up's exist: down is a
    NeuZip weight decoded into a shared slot (a kept decode or a layer group's buffer is the one the update writes
    into, so the second pass could not read the old values there; those runs have memory to spare anyway)."""
    if not isinstance(down, CompressedLinear):
        return False
    weight = down.compressed
    return weight.group is None and not DECODE_BUFFERS.keeps(weight)


def chunkable(mlp: torch.nn.Module) -> bool:
    """Whether ``mlp`` is a gated MLP this module can chunk: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``
    over bias-free plain or NeuZip linears (an adapter, a bias or another layout keeps its own forward)."""
    projs = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if not callable(getattr(mlp, "act_fn", None)):
        return False
    for proj in projs:
        if type(proj) is torch.nn.Linear:
            if proj.bias is not None:
                return False
        elif not (isinstance(proj, CompressedLinear) and proj.bias is None):
            return False
    return True


def chunked_mlp_forward(mlp: torch.nn.Module, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``mlp(x)`` with its intermediates one ``chunk`` of tokens at a time (see the module docstring)."""
    if x.numel() // x.shape[-1] <= chunk:
        return getattr(mlp, _ORIGINAL_FORWARD)(x)
    projs = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    grad_inputs = [_grad_input(p) for p in projs]
    grad_enabled = torch.is_grad_enabled()
    needs = grad_enabled and (x.requires_grad or any(t.requires_grad for t in grad_inputs))
    if not needs:
        with torch.no_grad():
            ws = _weights(projs)
            out = _forward_rows(mlp, x.reshape(-1, x.shape[-1]), ws, chunk)
        return out.view(*x.shape[:-1], out.shape[-1])
    keys = [t for t in grad_inputs if t.requires_grad]
    saved_x = _SavedMLPInput.apply(x, *keys)
    return _ChunkedMLPFunction.apply(saved_x, saved_x.grad_fn, mlp, chunk, *grad_inputs)


def chunk_mlps(model: torch.nn.Module, chunk_tokens: int) -> int:
    """Make every chunkable gated MLP of ``model`` run ``chunk_tokens`` tokens at a time; return their number.

    ``chunk_tokens`` 0 restores their own forward. Inputs of at most ``chunk_tokens`` tokens run unchunked.
    """
    count = 0
    for module in model.modules():
        if not chunkable(module):
            continue
        original = module.__dict__.get(_ORIGINAL_FORWARD)
        if original is None:
            original = module.forward
            setattr(module, _ORIGINAL_FORWARD, original)
        if chunk_tokens > 0:
            module.forward = (lambda m, c: lambda x: chunked_mlp_forward(m, x, c))(module, int(chunk_tokens))
        else:
            module.forward = original
        count += 1
    return count
