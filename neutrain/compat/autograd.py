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
