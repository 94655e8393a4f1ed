"""Tiny Llama models and a fused training loop shared by the compressed-module tests."""

import copy

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from neutrain.nn import causal_lm_loss, compress_model, decompressed_state_dict

# Short codec lanes keep the CPU reference decoder fast on tiny tensors.
CODEC = {"steps": 16}
# Tiles of 2048 elements: the 256 x 64 vocabulary matrices are 8 tiles (32 rows each), so their
# streamed updates decode and re-encode them block by block (neutrain.nn.row_blocks).
BLOCK_CODEC = {"steps": 2}
VOCAB = 256


class GradCapture:
    """Stands in for a fused optimizer: records (sums) the weight gradients handed to it."""

    def __init__(self):
        self.grads = {}

    def consume_grad_(self, key, grad, io):
        self.grads[key] = self.grads.get(key, 0) + grad


def tiny_config(tie=False, layers=2, hidden=64):
    return LlamaConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=tie, max_position_embeddings=64,
    )


def tiny_llama(tie=False, seed=0, **kw):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(tie, **kw), dtype=torch.bfloat16)
    return model.train()


def dense_and_compressed(tie=False, seed=0, codec=CODEC, layers=2):
    dense = tiny_llama(tie, seed, layers=layers)
    compressed = copy.deepcopy(dense)
    if tie:
        assert compressed.lm_head.weight is compressed.model.embed_tokens.weight
    compress_model(compressed, progress=False, codec_options=codec)
    return dense, compressed


def token_batches(n, seed=0, batch=2, length=12):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, length), generator=g) for _ in range(n)]


def train(model, opt, data, **loss_options):
    opt.bind(model)
    norms = []
    for ids in data:
        opt.backward(causal_lm_loss(model, ids, ids, **loss_options))
        opt.step()
        norms.append(opt.grad_norm())
    return norms


def weights(model):
    """Dense view of every weight (compressed ones decoded), by dense name."""
    return {k: v.clone() for k, v in decompressed_state_dict(model).items()}


def enable_checkpointing(model):
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    key = "activation_checkpointing_kwargs" if enable.__name__.startswith("activation") else "gradient_checkpointing_kwargs"
    enable(**{key: {"use_reentrant": False}})
    model.train()
