"""GPU: block-by-block re-encode of the vocabulary matrices at full tile size, without a
host synchronisation, bit-identical to dense + fused training."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from neutrain.compress import compress
from neutrain.compress.blocks import block_recode, tile_numel
from neutrain.compress.tensor import CompressedTensor
from neutrain.nn import causal_lm_loss, compress_model, decompressed_state_dict
from neutrain.optim import LOMO

pytestmark = pytest.mark.gpu


def test_block_recode_writes_the_bytes_of_a_whole_encode_without_a_sync():
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(16384, 4096, device="cuda", generator=g).mul(0.02).bfloat16()
    ct = compress(w)
    new = (w.float() + torch.randn(w.shape, device="cuda", generator=g) * 1e-3).bfloat16()
    whole = CompressedTensor.from_state_dict({k: v.clone() for k, v in ct.state_dict().items()})
    whole._encode(new, "auto", fresh_code=True)
    tile_len, block_tiles = tile_numel(ct), 512
    buffer = torch.empty(block_tiles * tile_len, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        recode = block_recode(ct)
        for first in range(0, ct.tiles, block_tiles):
            old = recode.decode(first, min(first + block_tiles, ct.tiles), buffer)
            old.copy_(new.view(-1)[first * tile_len : first * tile_len + old.numel()])
            recode.encode(first, old)
        recode.finish()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert ct.stream_words == whole.stream_words
    assert torch.equal(ct.stream[: ct.stream_words], whole.stream[: whole.stream_words])
    for field in ("tails", "lane_words", "tile_base"):
        assert torch.equal(getattr(ct, field), getattr(whole, field)), field
    assert torch.equal(ct.decompress().view(torch.int16), new.view(torch.int16))


@pytest.mark.xfail(strict=True, reason="H100 at 37ed85a: the first block re-encode of the lm_head encodes values "
                   "other than the weight's (3.1 % more coded bits, a code rebuild next step); the block path is "
                   "off on CUDA (row_blocks.ON_CUDA) until this passes")
def test_blocked_vocabulary_training_is_bit_identical_to_dense_and_sync_free(monkeypatch):
    from neutrain.nn import row_blocks

    monkeypatch.setattr(row_blocks, "ON_CUDA", True)
    vocab, hidden = 32768, 256
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=vocab, tie_word_embeddings=False)
    dense = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().train()
    model = copy.deepcopy(dense)
    compress_model(model, progress=False)
    ids = torch.randint(0, vocab, (2, 128), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    # lr 1e-4: at 1e-3 one of the four lm_head updates took the whole path on the H100 (3363aca), as a
    # code rebuild falls back to (the exponents drift past 1 % in a few steps of this tiny model).
    options = {"lr": 1e-4, "clip_mode": "per_tensor", "max_grad_norm": 1.0, "chunk_numel": 1 << 20}
    loss_options = {"chunk_bytes": 4 * ids.numel() * 4096}  # 4096-row vocabulary chunks
    lm_head = model.lm_head.compressed
    blocked = []
    original = type(lm_head).write_blocks_
    lm_head.write_blocks_ = lambda blocks: (blocked.append(blocks.reader is not None), original(lm_head, blocks))[1]

    def run(net, steps, sync_free_after=None):
        opt = LOMO(net.parameters(), **options).bind(net)
        for step in range(steps):
            if step == sync_free_after:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                opt.backward(causal_lm_loss(net, ids, ids, **loss_options))
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        return opt

    decodes = lm_head.decodes, model.model.embed_tokens.compressed.decodes
    opt = run(model, 4, sync_free_after=2)  # the first steps may read back (codes, streams sized)
    run(dense, 4)
    assert opt.streamed_updates == 8 and blocked == [True] * 4, (blocked, lm_head.ct.rebuilds)
    assert (lm_head.decodes, model.model.embed_tokens.compressed.decodes) == decodes  # never decoded whole
    want, got = decompressed_state_dict(dense), decompressed_state_dict(model)
    for name in want:
        assert torch.equal(got[name].view(torch.int16), want[name].view(torch.int16)), name
