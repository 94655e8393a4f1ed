"""Writing tiny GGUF checkpoints for tests, as llama.cpp's converter lays them out.

A random Llama (transformers) is written with the ``gguf`` package's writer: llama.cpp tensor
names, Q/K rows permuted the way ``convert_hf_to_gguf.py`` permutes them (transformers undoes it
when loading), a ``gpt2``-type BPE vocabulary with merges, special token ids and a chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# transformers' Llama parameter -> llama.cpp's tensor name (per layer: blk.<i>.<name>.weight).
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's Q/K row order (interleaved rotary halves), as convert_hf_to_gguf.py writes it."""
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def tiny_tokenizer():
    """A byte-level BPE with merges (vocabulary 300), specials <|pad|> <|bos|> <|eos|> and a chat template."""
    from neutrain.data import train_bpe_tokenizer

    texts = ["def add(a, b):\n    return a + b\n", "the quick brown fox jumps", "user: what is 2+3? assistant: 5"]
    return train_bpe_tokenizer(texts * 20, vocab_size=300)


def tiny_llama(vocab_size: int, seed: int = 0, tie: bool = False):
    """A random 2-layer Llama (hidden 64) in fp32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=tie, rms_norm_eps=1e-5, rope_theta=10000.0)
    return LlamaForCausalLM(config).eval()


def write_gguf(path: Path, model, tokenizer, tensor_type: str = "F32", chat_template: bool = True) -> Path:
    """Write ``model`` (a transformers Llama) and ``tokenizer`` as a llama.cpp GGUF file.

    ``tensor_type``: ``F32``, ``F16``, ``BF16`` or ``Q8_0`` for the matrices (norms stay F32, as
    llama.cpp keeps them).
    """
    import gguf
    import numpy as np

    cfg = model.config
    qtype = getattr(gguf.GGMLQuantizationType, tensor_type)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(cfg.vocab_size)
    backend = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = [t for t, _ in sorted(backend["vocab"].items(), key=lambda kv: kv[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    special = set(tokenizer.all_special_tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in backend["merges"]])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    if chat_template:
        writer.add_chat_template(tokenizer.chat_template)
    for name, param in model.state_dict().items():
        tensor = param.detach().float()
        if name in _TOP:
            gname = _TOP[name]
        else:
            parts = name.split(".")
            module = ".".join(parts[3:-1])
            gname = f"blk.{parts[2]}.{_LAYER[module]}.weight"
            if module == "self_attn.q_proj":
                tensor = _permute(tensor, cfg.num_attention_heads)
            elif module == "self_attn.k_proj":
                tensor = _permute(tensor, cfg.num_key_value_heads)
        data = tensor.numpy()
        if tensor.dim() == 2 and tensor_type != "F32":
            writer.add_tensor(gname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gname, data.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
