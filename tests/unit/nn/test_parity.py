"""Compressed + fused training is bit-identical to dense + fused training."""

import pytest
import torch

import neutrain.optim.lomo as lomo_module

from neutrain.nn import CompressedEmbedding, CompressedLinear, compressed_weights
from neutrain.nn.embedding import table_grad_rows
from neutrain.optim import LOMO, AdaLomo

from .nn_helpers import BLOCK_CODEC, CODEC, VOCAB, dense_and_compressed, enable_checkpointing, token_batches, train, weights


def _assert_identical_and_trained(dense, compressed, start):
    a, b = weights(dense), weights(compressed)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    changed = sum(int((a[n] != start[n]).sum()) for n in a)
    total = sum(a[n].numel() for n in a)
    assert changed >= total / 2, f"only {changed}/{total} weights changed: updates rounded away?"


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda params: LOMO(params, lr=0.1, stochastic_rounding=False),
        lambda params: AdaLomo(params, lr=2e-2, clip_mode="per_tensor", max_grad_norm=1.0, seed=3),
    ],
    ids=["lomo-nearest", "adalomo-stochastic"],
)
@pytest.mark.slow
def test_compressed_matches_dense_bit_for_bit(make_opt):
    dense, compressed = dense_and_compressed()
    assert isinstance(compressed.lm_head, CompressedLinear)
    assert isinstance(compressed.model.embed_tokens, CompressedEmbedding)
    start = weights(dense)
    data = token_batches(3)
    norms_dense = train(dense, make_opt(dense.parameters()), data)
    norms_compressed = train(compressed, make_opt(compressed.parameters()), data)
    assert norms_dense == norms_compressed
    _assert_identical_and_trained(dense, compressed, start)
    for weight in compressed_weights(compressed):
        assert weight.version == 3, weight.name  # re-encoded once per step


@pytest.mark.slow
@pytest.mark.parametrize("keep", [True, False], ids=["kept", "slots"])
def test_activation_checkpointing_composes_and_decodes_again(keep, monkeypatch):
    from neutrain.nn import DECODE_BUFFERS

    if not keep:
        monkeypatch.setitem(DECODE_BUFFERS.keep_bytes, torch.device("cpu"), 0)
    dense, compressed = dense_and_compressed()
    enable_checkpointing(compressed)
    start = weights(dense)
    data = token_batches(2, seed=4)
    train(dense, LOMO(dense.parameters(), lr=0.1, stochastic_rounding=False), data)
    q_proj = compressed.model.layers[0].self_attn.q_proj.compressed
    before = q_proj.decodes
    train(compressed, LOMO(compressed.parameters(), lr=0.1, stochastic_rounding=False), data)
    # In the shared slots, forward, checkpoint recompute and backward each decode: 3 per step (2 without
    # checkpointing). Kept (the CPU default), the forward's decode serves the recompute, the backward and
    # the update; the update's re-encode makes the next step decode again: 1 per step.
    assert q_proj.decodes - before == (1 if keep else 3) * len(data)
    assert DECODE_BUFFERS.keeps(q_proj) == keep
    _assert_identical_and_trained(dense, compressed, start)


@pytest.mark.slow
def test_tied_embedding_and_lm_head_share_one_tensor_updated_once():
    dense, compressed = dense_and_compressed(tie=True)
    shared = compressed.model.embed_tokens.compressed
    assert compressed.lm_head.compressed is shared
    start = weights(dense)
    data = token_batches(3, seed=7)
    train(dense, LOMO(dense.parameters(), lr=0.1, stochastic_rounding=False), data)
    opt = LOMO(compressed.parameters(), lr=0.1, stochastic_rounding=False)
    train(compressed, opt, data)
    assert shared.version == 3  # one update per step, from the summed gradient
    assert opt.hooks.tied == {shared.key}
    _assert_identical_and_trained(dense, compressed, start)


@pytest.mark.slow
@pytest.mark.parametrize(
    "block_rows, chunk_rows, stochastic_rounding, clip, re_encoded_by_blocks",
    [(40, 8, False, {}, False), (4, 8, True, {}, False),
     (40, 8, True, {"clip_mode": "global_exact", "max_grad_norm": 1.5}, False),
     (4, 8, True, {}, True), (16, 64, False, {"clip_mode": "per_tensor", "max_grad_norm": 0.5}, True),
     (8, 4, True, {}, True), (64, 8, False, {}, True)],
    ids=["blocks-of-chunks", "chunks-of-blocks", "stochastic-exact-clip", "tile-blocks-stochastic",
         "tile-blocks-clipped", "tile-blocks-of-chunks", "tile-blocks-own-buffer"],
)
def test_streamed_lm_head_update_matches_full_gradient(block_rows, chunk_rows, stochastic_rounding, clip,
                                                       re_encoded_by_blocks, monkeypatch):
    # The lm_head (256 x 64) is updated in row blocks, each from a recomputed gradient block;
    # the dense twin gets the full gradient through autograd. Loss chunks: chunk_rows rows.
    # With 2048-element tiles (32 rows) the vocabulary matrices are also decoded and re-encoded
    # block by block (neutrain.nn.row_blocks): never read whole. The loss's reader blocks are
    # aligned chunks; the update shares the reader's buffer where they hold whole update chunks
    # (all but "own-buffer": 32-row reader blocks, 64-row update chunks).
    _check_streamed_lm_head(block_rows, chunk_rows, stochastic_rounding, clip, re_encoded_by_blocks, monkeypatch)


@pytest.mark.slow
def test_streamed_update_in_the_fused_kernel_order_shares_the_reader_buffer(monkeypatch):
    # LOMO's fused kernel path (CUDA) asks for a chunk's gradient before its weight rows, so the loss's
    # reader moves to the next block first and must have the update re-encode the block it holds.
    # The kernel runs in Triton's interpreter here, for the dense twin too (same rounding both sides). Its time
    # grows with the elements it updates: one decoder layer, and the kernel only for the vocabulary matrices
    # (the dense twin's and the compressed model's row blocks), since only their order is tested; the layer's
    # matrices take the unfused rule on both sides.
    fused = []

    def vocabulary_matrix(weight) -> bool:  # lm_head and embedding: VOCAB x hidden (64); no layer matrix has VOCAB rows
        if tuple(weight.shape) != (VOCAB, 64):
            return False
        fused.append(type(weight).__name__)
        return True

    monkeypatch.setattr(lomo_module, "use_fused_kernel", vocabulary_matrix)
    _check_streamed_lm_head(4, 8, True, {}, True, monkeypatch, layers=1)
    # The kernel ran for both vocabulary matrices of both models, each step (2 steps).
    assert sorted(fused) == ["RowBlocks"] * 4 + ["Tensor"] * 4, fused


def _check_streamed_lm_head(block_rows, chunk_rows, stochastic_rounding, clip, re_encoded_by_blocks, monkeypatch,
                            layers=2):
    dense, compressed = dense_and_compressed(codec=BLOCK_CODEC if re_encoded_by_blocks else CODEC, layers=layers)
    reads, shared = [], []
    for weight in (compressed.lm_head.compressed, compressed.model.embed_tokens.compressed):
        monkeypatch.setattr(weight, "read", lambda w=weight: (reads.append(w.name), type(w).read(w))[1])
    lm_head = compressed.lm_head.compressed
    monkeypatch.setattr(lm_head, "write_blocks_",
                        lambda blocks: (shared.append(blocks.reader is not None), type(lm_head).write_blocks_(
                            lm_head, blocks))[1])
    start = weights(dense)
    data = token_batches(2, seed=11)
    loss_options = {"chunk_bytes": 4 * data[0].numel() * chunk_rows}

    def make(params):
        return LOMO(params, lr=0.1, stochastic_rounding=stochastic_rounding, seed=4, chunk_numel=64 * block_rows,
                    **clip)

    train(dense, make(dense.parameters()), data, **loss_options)
    opt = make(compressed.parameters())
    decodes = compressed.lm_head.compressed.decodes
    norms = train(compressed, opt, data, **loss_options)
    assert opt.streamed_updates == 2 * len(data)  # the lm_head and the embedding, once per step each
    assert (reads == []) == re_encoded_by_blocks, reads
    assert (compressed.lm_head.compressed.decodes == decodes) == re_encoded_by_blocks  # no whole decode
    if re_encoded_by_blocks:  # the update's blocks are the loss reader's unless they cannot hold whole chunks
        assert shared == [block_rows <= 32] * len(data), shared
    if clip:
        assert min(norms) > clip["max_grad_norm"], "the exact global clip must engage"
    _assert_identical_and_trained(dense, compressed, start)


@pytest.mark.parametrize("block_rows", [1, 7, 64, 300], ids=["row", "odd", "quarter", "whole"])
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_table_gradient_blocks_equal_the_whole_table_gradient(block_rows, padding_idx):
    # Fresh random ids with repeats (the same row from several tokens) and the padding id present.
    g = torch.Generator().manual_seed(block_rows)
    ids = torch.randint(0, 256, (3, 40), generator=g)
    ids[0, :5] = 3
    ids[1, 7] = ids[2, 9] = 255
    grad_out = torch.randn(3, 40, 16, generator=g).bfloat16()
    pad = -1 if padding_idx is None else padding_idx
    full = torch.ops.aten.embedding_dense_backward(grad_out, ids, 256, pad, False)
    blocks = [table_grad_rows(grad_out.reshape(-1, 16), ids.reshape(-1), slice(s, s + block_rows), 256, pad)
              for s in range(0, 256, block_rows)]
    assert torch.equal(torch.cat(blocks), full)
    if padding_idx is not None:
        assert not full[3].any()


@pytest.mark.slow
def test_streamed_embedding_never_builds_the_table_gradient():
    # The embedding (256 x 64) gets its update from row blocks: no vocabulary-sized tensor is
    # handed to the optimizer, and the result equals the dense twin's whole-gradient update.
    dense, compressed = dense_and_compressed()
    start = weights(dense)
    data = token_batches(2, seed=5)
    seen = []
    opt = LOMO(compressed.parameters(), lr=0.1, stochastic_rounding=False, chunk_numel=64 * 16,
               clip_mode="per_tensor", max_grad_norm=0.5)
    original = opt.consume_grad_
    opt.consume_grad_ = lambda key, grad, io: (seen.append(tuple(grad.shape)), original(key, grad, io))[1]
    train(dense, LOMO(dense.parameters(), lr=0.1, stochastic_rounding=False, chunk_numel=64 * 16,
                      clip_mode="per_tensor", max_grad_norm=0.5), data)
    train(compressed, opt, data)
    assert (256, 64) not in seen
    assert opt.streamed_updates == 2 * len(data)
    _assert_identical_and_trained(dense, compressed, start)
