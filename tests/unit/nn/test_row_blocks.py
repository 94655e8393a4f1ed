"""The vocabulary matrix's streamed update decodes and re-encodes it a row block at a time (issue 30).

Measured on the CPU allocator (the CPU plays the device, as in test_phase_memory.py): the update's
peak beyond what was allocated before is a block buffer, the second exponent stream and a chunk's
fp32 temporaries, not the dense matrix the whole read put in the large decode slot.
"""

import pytest
import torch

import neutrain.nn.row_blocks as row_blocks_module
from neutrain.compress import compress
from neutrain.nn import CompressedEmbedding
from neutrain.nn.weight import CompressedWeight
from neutrain.optim import LOMO

from .phase_peaks import host_peak

VOCAB, HIDDEN = 4096, 64
CHUNK_ROWS = 128  # the optimizer's row chunk; tiles of 2048 elements are 32 rows: blocks of 128 rows


def _table(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, HIDDEN, generator=g).mul(0.02).bfloat16()


def _embedding(table):
    emb = CompressedEmbedding(CompressedWeight(compress(table, steps=2), name="embed"))
    opt = LOMO(emb.parameters(), lr=0.1, stochastic_rounding=False, chunk_numel=CHUNK_ROWS * HIDDEN)
    opt.bind(emb)
    return emb, opt


def _step(emb, opt, ids):
    opt.backward(emb(ids).float().square().sum())
    opt.step()


@pytest.mark.parametrize("by_blocks", [True, False], ids=["blocks", "whole"])
def test_the_streamed_embedding_update_never_decodes_the_table_whole(by_blocks, monkeypatch):
    if not by_blocks:  # the read before issue 30: the table decoded whole for the update
        monkeypatch.setattr(row_blocks_module, "MAX_BLOCK_FRACTION", 0.0)
    table = _table()
    ids = torch.randint(0, VOCAB, (4, 64), generator=torch.Generator().manual_seed(1))
    emb, opt = _embedding(table)
    _, peak = host_peak(lambda: None, lambda _: _step(emb, opt, ids))
    assert opt.streamed_updates == 1
    matrix = VOCAB * HIDDEN * 2
    if by_blocks:
        # Block buffer 1/32, chunk temporaries ~1/8, the second stream ~1/5 of the matrix.
        assert peak <= 0.45 * matrix, peak / matrix
    else:
        assert peak >= matrix, peak / matrix
    # Either way the table is the dense update of the old one, exactly.
    dense = torch.nn.Embedding(VOCAB, HIDDEN).bfloat16()
    dense.weight.data.copy_(table)
    ref = LOMO(dense.parameters(), lr=0.1, stochastic_rounding=False, chunk_numel=CHUNK_ROWS * HIDDEN)
    ref.bind(dense)
    _step(dense, ref, ids)
    assert torch.equal(emb.compressed.decode().view(torch.int16), dense.weight.detach().view(torch.int16))


def test_row_blocks_visit_in_order_and_keep_skipped_blocks():
    table = _table(2)
    weight = CompressedWeight(compress(table, steps=2))
    blocks = weight.row_blocks(CHUNK_ROWS)
    assert blocks is not None and blocks.block_rows == CHUNK_ROWS and blocks.blocks == VOCAB // CHUNK_ROWS
    blocks[0:CHUNK_ROWS].add_(1.0)
    blocks[5 * CHUNK_ROWS : 5 * CHUNK_ROWS + 3].mul_(2.0)  # blocks 1-4 and 6.. are never touched
    with pytest.raises(ValueError, match="not inside one block"):
        blocks[5 * CHUNK_ROWS : 7 * CHUNK_ROWS]
    with pytest.raises(ValueError, match="in order"):
        blocks[0:4]
    weight.write_blocks_(blocks)
    want = table.clone()
    want[:CHUNK_ROWS] += 1.0
    want[5 * CHUNK_ROWS : 5 * CHUNK_ROWS + 3] *= 2.0
    assert torch.equal(weight.decode().view(torch.int16), want.view(torch.int16))
    assert weight.version == 1


def test_no_row_blocks_where_they_would_not_pay():
    weight = CompressedWeight(compress(_table(), steps=2))
    assert weight.row_blocks(VOCAB) is None  # one block: the whole matrix anyway
    assert CompressedWeight(compress(_table(), 3, steps=2)).row_blocks(CHUNK_ROWS) is None  # lossy
