"""A compressed training step issues the dense step's matrix products, checkpoint recompute included.

Counted with a dispatch mode: every ``mm`` / ``addmm`` / ``bmm`` of one fused step, by operand shapes
and layouts. Under non-reentrant activation checkpointing the recompute stops at the last tensor backward
needs; the compressed linear must save its input before its product, as a native ``mm`` does, or the
recompute runs the layer's last product (``down_proj``) for nothing. The one difference left is the
streamed lm_head update's norm pass under per-tensor clipping (two products per vocabulary chunk:
:mod:`neutrain.optim.streamed`), which a single-pass clip mode does not take.
"""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from neutrain.optim import LOMO

from .nn_helpers import VOCAB, dense_and_compressed, enable_checkpointing, token_batches, weights

PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "_scaled_mm"}


class _Products(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in PRODUCTS:
            mats = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2][-2:]
            self.count[(name, *[(tuple(m.shape), m.is_contiguous()) for m in mats])] += 1
        return func(*args, **(kwargs or {}))


def _products_per_step(model, clip: dict, chunk_rows: int, data) -> list[collections.Counter]:
    from neutrain.nn import causal_lm_loss

    enable_checkpointing(model)
    opt = LOMO(model.parameters(), lr=0.1, stochastic_rounding=False, chunk_numel=64 * 2 * chunk_rows,
               **clip).bind(model)
    counts = []
    for ids in data:
        with _Products() as mode:
            opt.backward(causal_lm_loss(model, ids, ids, chunk_bytes=4 * ids.numel() * chunk_rows))
            opt.step()
        counts.append(mode.count)
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("clip", [{}, {"clip_mode": "per_tensor", "max_grad_norm": 0.5}], ids=["none", "per_tensor"])
def test_a_checkpointed_compressed_step_runs_the_dense_steps_products(clip):
    dense, compressed = dense_and_compressed()
    data = token_batches(2, seed=6)
    chunk_rows = 32
    expected = _products_per_step(dense, clip, chunk_rows, data)
    got = _products_per_step(compressed, clip, chunk_rows, data)
    extra = collections.Counter()
    if clip:  # the norm pass: each chunk's logits and weight-gradient products once more
        tokens, hidden = data[0].numel(), dense.config.hidden_size
        extra[("mm", ((tokens, hidden), True), ((hidden, chunk_rows), False))] = VOCAB // chunk_rows
        extra[("mm", ((chunk_rows, tokens), False), ((tokens, hidden), True))] = VOCAB // chunk_rows
    for step, (want, have) in enumerate(zip(expected, got)):
        more, fewer = have - (want + extra), (want + extra) - have
        assert not more and not fewer, f"step {step}: compressed runs {dict(more)} more, {dict(fewer)} fewer"
    a, b = weights(dense), weights(compressed)
    assert all(torch.equal(a[n], b[n]) for n in a), "compressed and dense diverged"
