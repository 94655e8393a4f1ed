"""The single-pass streamed lm_head update (global_stale, none): one lm_head gradient pass, same bits.

The CUDA variants (``-m gpu``) run LOMO's ``fused_update`` kernel, whose write-back is the one that
keeps the non-finite elements there.
"""

import copy
import importlib

import pytest
import torch

from neutrain.optim import LOMO

from neutrain.nn import compress_model

from .nn_helpers import dense_and_compressed, tiny_llama, token_batches, train, weights

lce = importlib.import_module("neutrain.nn.linear_cross_entropy")  # the package exports a function of that name
NAN, INF = float("nan"), float("inf")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _twins(device: str):
    """A tiny untied bf16 Llama on ``device`` and its compressed copy (compressed where it lives)."""
    if device == "cpu":
        return dense_and_compressed()
    dense = tiny_llama().to(device)
    compressed = copy.deepcopy(dense)
    compress_model(compressed, progress=False)  # the GPU codec's own lanes
    return dense, compressed


def _lomo(params, block_rows, **clip):
    return LOMO(params, lr=0.1, stochastic_rounding=True, seed=4, chunk_numel=64 * block_rows, **clip)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_rows, chunk_rows", [(40, 8), (4, 8)], ids=["blocks-of-chunks", "chunks-of-blocks"])
def test_single_pass_update_equals_the_full_gradient_update_under_global_stale(block_rows, chunk_rows, device):
    # Dense twin: the full lm_head gradient through autograd. Compressed: streamed; step 1 has no
    # previous norm (per_tensor fallback, two passes), steps 2-3 run single-pass with the stale coefficient.
    dense, compressed = _twins(device)
    start = weights(dense)
    data = [ids.to(device) for ids in token_batches(3, seed=11)]
    loss_options = {"chunk_bytes": 4 * data[0].numel() * chunk_rows}
    clip = {"clip_mode": "global_stale", "max_grad_norm": 0.5}
    norms_dense = train(dense, _lomo(dense.parameters(), block_rows, **clip), data, **loss_options)
    opt = _lomo(compressed.parameters(), block_rows, **clip)
    norms = train(compressed, opt, data, **loss_options)
    assert norms == norms_dense and min(norms) > clip["max_grad_norm"], "the stale clip must engage"
    assert opt.streamed_updates == 2 * len(data)  # lm_head and embedding, once per step each
    assert opt.streamed.single_pass == 2 * (len(data) - 1)  # both, from step 2 on
    a, b = weights(dense), weights(compressed)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert not torch.equal(a["lm_head.weight"], start["lm_head.weight"])


def _logits_products_per_step(monkeypatch, **clip) -> list[int]:
    """lm_head logit products (each backward one is followed by one weight-gradient product) per step."""
    calls = {"n": 0}
    original = lce._chunk_logits

    def counting(*args):
        calls["n"] += 1
        return original(*args)

    monkeypatch.setattr(lce, "_chunk_logits", counting)
    _, compressed = dense_and_compressed()
    opt = _lomo(compressed.parameters(), 16, **clip).bind(compressed)
    per_step = []
    for ids in token_batches(3, seed=2):
        before = calls["n"]
        opt.backward(lce.causal_lm_loss(compressed, ids, ids, chunk_bytes=4 * ids.numel() * 32))
        opt.step()
        per_step.append(calls["n"] - before)
    return per_step


@pytest.mark.slow
def test_single_pass_drops_the_second_lm_head_gradient_pass(monkeypatch):
    chunks = 256 // 32  # vocabulary / chunk rows
    # forward: one product per chunk; backward: two passes (norm, then update) or one
    assert _logits_products_per_step(monkeypatch, clip_mode="per_tensor", max_grad_norm=0.5) == [3 * chunks] * 3
    assert _logits_products_per_step(monkeypatch, clip_mode="global_stale", max_grad_norm=0.5) == [3 * chunks] + [2 * chunks] * 2
    assert _logits_products_per_step(monkeypatch) == [2 * chunks] * 3  # no clipping: single pass from step 1


def _poison(grad: torch.Tensor, rows: slice, row: int) -> None:
    """NaN and inf in gradient row ``row`` (if within ``rows``, the rows ``grad`` holds)."""
    if rows.start <= row < rows.stop:
        grad[row - rows.start, :3] = NAN
        grad[row - rows.start, 3] = -INF


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_gradient_keeps_those_elements_on_both_paths(device):
    # Step 2 (single pass under global_stale) gets NaN/inf in row 70 of the lm_head gradient: the whole-
    # gradient path (dense) and the streamed one (compressed) both keep exactly those elements, update the
    # rest, flag the tensor and leave it out of the step's norm.
    dense, compressed = _twins(device)
    data = [ids.to(device) for ids in token_batches(3, seed=6)]
    step, row = {"n": 0}, 70
    clip = {"clip_mode": "global_stale", "max_grad_norm": 0.5}

    def poison_dense(g):
        if step["n"] == 2:
            g = g.clone()
            _poison(g, slice(0, g.shape[0]), row)
        return g

    dense.lm_head.weight.register_hook(poison_dense)
    head = compressed.lm_head.compressed
    streamed = head.apply_streamed_grad

    def poisoned_stream(grad_rows, sumsq):
        def rows_of(rows):
            g = grad_rows(rows)
            if step["n"] == 2:
                _poison(g, rows, row)
            return g

        streamed(rows_of, sumsq)

    head.apply_streamed_grad = poisoned_stream
    results = {}
    for name, model in (("dense", dense), ("compressed", compressed)):
        opt = _lomo(model.parameters(), 16, **clip).bind(model)
        snapshots, norms, skipped = [], [], []
        for n, ids in enumerate(data, 1):
            step["n"] = n
            snapshots.append(weights(model)["lm_head.weight"])
            opt.backward(lce.causal_lm_loss(model, ids, ids))
            opt.step()
            norms.append(opt.grad_norm())
            skipped.append([n.removesuffix("_key") for n in opt.last_skipped])  # a compressed weight's key name
        results[name] = (weights(model), snapshots, norms, skipped, opt)
    (wd, snap, norms, skipped, _), (wc, _, norms_c, skipped_c, opt_c) = results["dense"], results["compressed"]
    for name in wd:
        assert torch.equal(wd[name], wc[name]), name
    assert norms == norms_c and all(torch.isfinite(torch.tensor(norms)))
    assert skipped == skipped_c and skipped[0] == skipped[2] == [] and skipped[1] == ["lm_head.weight"]
    assert opt_c.streamed.single_pass == 2 * (len(data) - 1) and opt_c.nonfinite_skips == 1
    after_step2 = snap[2]
    assert torch.equal(after_step2[row, :4], snap[1][row, :4])  # the poisoned elements kept their values
    assert not torch.equal(after_step2[row, 4:], snap[1][row, 4:])  # the rest of the row was updated
    assert torch.isfinite(wc["lm_head.weight"]).all()
