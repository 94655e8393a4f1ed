"""GPU: a fused training step makes no host synchronisation; the table gradient's row blocks are exact on CUDA."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from neutrain.nn import causal_lm_loss, compress_model
from neutrain.nn.embedding import table_grad_rows
from neutrain.optim import AdaLomo, LOMO

from .nn_helpers import enable_checkpointing

pytestmark = pytest.mark.gpu


def _llama(vocab=512, hidden=256, layers=2):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, vocab_size=vocab, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().train()


@pytest.mark.parametrize("weights", ["dense", "neuzip-lossless", "neuzip-lossless-prefetch"])
@pytest.mark.parametrize("make_opt", [
    lambda p: LOMO(p, lr=1e-3, clip_mode="per_tensor", max_grad_norm=1.0),
    lambda p: AdaLomo(p, lr=1e-3, clip_mode="per_tensor", max_grad_norm=1.0),
    lambda p: LOMO(p, lr=1e-3, clip_mode="global_stale", max_grad_norm=1.0),  # the single-pass streamed lm_head
], ids=["lomo", "adalomo", "lomo-stale"])
def test_training_step_makes_no_host_sync(weights, make_opt, monkeypatch):
    from neutrain.nn import DECODE_BUFFERS, PREFETCHER

    if weights.endswith("-prefetch"):  # the side-stream decode-ahead: events and stream waits only
        monkeypatch.setattr(PREFETCHER, "enabled", True)
        PREFETCHER.reset()
    launched = PREFETCHER.launched
    model = _llama()
    if weights != "dense":
        compress_model(model, progress=False)
    enable_checkpointing(model)
    model.config.use_cache = False
    opt = make_opt(model.parameters()).bind(model)
    ids = torch.randint(0, 512, (2, 128), device="cuda")

    def step():
        opt.backward(causal_lm_loss(model, ids, ids))
        opt.step()

    for _ in range(3):  # warm-up: buffers, codes and streams sized; the first steps may read back
        step()
    torch.cuda.synchronize()
    norm_before = opt.last_grad_norm.clone()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert opt.steps_done == 5
    assert opt.nonfinite_skips == 0 and opt.last_skipped == []
    assert torch.isfinite(opt.last_grad_norm) and not torch.equal(opt.last_grad_norm, norm_before)
    assert (PREFETCHER.launched > launched) == weights.endswith("-prefetch")
    assert DECODE_BUFFERS.kept_nbytes(torch.device("cuda", 0)) == 0  # no kept decodes on a GPU by default
    PREFETCHER.reset()


@pytest.mark.parametrize("tokens", [1000, 8192])  # both CUDA kernels: per-feature (<= 3072 ids) and sorted
def test_table_gradient_blocks_equal_the_whole_table_gradient_on_cuda(tokens):
    g = torch.Generator(device="cuda").manual_seed(tokens)
    ids = torch.randint(0, 50_000, (tokens,), device="cuda", generator=g)
    ids[: tokens // 4] = ids[tokens // 2]  # many repeats of one row
    grad_out = torch.randn(tokens, 512, device="cuda", generator=g).bfloat16()
    full = torch.ops.aten.embedding_dense_backward(grad_out, ids, 50_000, 7, False)
    blocks = torch.cat([table_grad_rows(grad_out, ids, slice(s, s + 4096), 50_000, 7) for s in range(0, 50_000, 4096)])
    assert torch.equal(blocks, full)


def test_streamed_embedding_matches_dense_on_cuda():
    dense = _llama(vocab=4096)
    compressed = copy.deepcopy(dense)
    compress_model(compressed, progress=False)
    make = lambda p: LOMO(p, lr=5e-2, stochastic_rounding=False, chunk_numel=256 * 512,  # noqa: E731
                          clip_mode="per_tensor", max_grad_norm=1.0)
    data = [torch.randint(0, 4096, (4, 256), device="cuda") for _ in range(2)]
    opts = []
    for model in (dense, compressed):
        opt = make(model.parameters()).bind(model)
        for ids in data:
            opt.backward(causal_lm_loss(model, ids, ids))
            opt.step()
        opts.append(opt)
    assert opts[1].streamed_updates == 2 * len(data)
    from neutrain.nn import decompressed_state_dict

    a, b = decompressed_state_dict(dense), decompressed_state_dict(compressed)
    for name in a:
        assert torch.equal(a[name], b[name]), name
