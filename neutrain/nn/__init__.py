"""Compressed modules and model conversion.

Example:
    >>> import torch
    >>> from transformers import LlamaConfig, AutoModelForCausalLM
    >>> from neutrain.nn import compress_model, causal_lm_loss
    >>> from neutrain.optim import LOMO
    >>> cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...                   num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    >>> model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    >>> report = compress_model(model, progress=False, codec_options={"steps": 16})
    >>> opt = LOMO(model.parameters(), lr=1e-3).bind(model)
    >>> ids = torch.randint(0, 64, (2, 8))
    >>> opt.backward(causal_lm_loss(model, ids, ids))   # weights updated and re-encoded here
    >>> opt.step()
"""

from neutrain.nn.convert import (
    CompressionReport,
    compress_model,
    compressed_weights,
    decompressed_state_dict,
    model_nbytes,
)
from neutrain.nn.embedding import CompressedEmbedding
from neutrain.nn.linear import CompressedLinear
from neutrain.nn.linear_cross_entropy import causal_lm_loss, linear_cross_entropy
from neutrain.nn.buffers import DECODE_BUFFERS
from neutrain.nn.prefetch import PREFETCHER
from neutrain.nn.weight import CompressedWeight

__all__ = [
    "CompressedEmbedding",
    "CompressedLinear",
    "CompressedWeight",
    "CompressionReport",
    "DECODE_BUFFERS",
    "PREFETCHER",
    "causal_lm_loss",
    "compress_model",
    "compressed_weights",
    "decompressed_state_dict",
    "linear_cross_entropy",
    "init_compressed",
    "load_compressed",
    "model_nbytes",
]


def __getattr__(name):
    # load_compressed/init_compressed pull in safetensors/transformers loading machinery: import on first use.
    if name == "load_compressed":
        from neutrain.nn import formats

        return formats.load_compressed
    if name == "init_compressed":
        from neutrain.nn import load

        return load.init_compressed
    raise AttributeError(f"module 'neutrain.nn' has no attribute {name!r}")
