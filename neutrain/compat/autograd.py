"""Private torch autograd touch points, each behind one named adapter.

Why private: "is autograd's engine running a backward right now?" has no public
API. The fused update must know it (a tied weight's first gradient arrives while
the other use's backward is still running; a prefetch must not fire during a
checkpoint recompute), and ``torch._C._current_graph_task_id`` has answered it
since torch 2.0 (-1 outside a backward). If a release removes it, this is the
one line to change, and ``tests/unit/compat/test_adapters.py`` says so first.

Example:
    >>> import torch
    >>> from neutrain.compat.autograd import in_backward
    >>> in_backward()
    False
    >>> seen = []
    >>> x = torch.ones(2, requires_grad=True)
    >>> _ = x.register_hook(lambda g: seen.append(in_backward()))
    >>> x.sum().backward()
    >>> seen
    [True]
"""

from __future__ import annotations

import torch


def in_backward() -> bool:
    """True while autograd's engine runs a backward pass (its hooks, a checkpoint's recompute)."""
    return torch._C._current_graph_task_id() != -1


def in_checkpointed_region() -> bool:
    """True inside a non-reentrant activation checkpoint's forward or its recompute.

    Why: there autograd keeps no tensor a forward saves beyond the recompute that precedes the layer's own
    backward, so a weight that lives in a buffer shared between layers may be handed to native products (its
    memory holds this layer's values whenever they are read). ``torch.utils.checkpoint`` marks those regions
    only by installing its saved-tensor hooks; the top hooks' module is the one line to change if that moves.
    False where it cannot tell: the caller then takes the path that saves nothing from the shared buffer.
    """
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint"
