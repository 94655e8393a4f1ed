"""Tiny Llama models (fp32, CPU) and helpers shared by the eval tests."""

import torch
import transformers

from neutrain import compat


def tiny_llama(layers: int = 4, vocab: int = 97, heads: int = 4, kv_heads: int = 2, hidden: int = 64, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=2 * hidden, vocab_size=vocab, max_position_embeddings=4096,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    # Larger-than-default weights make attention peaked, so a wrong key or value changes the logits visibly.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    return model


@torch.no_grad()
def decode_logits(model, ids: torch.Tensor, prompt_len: int, cache) -> torch.Tensor:
    """Teacher-forced logits: prefill ``ids[:, :prompt_len]`` then feed the rest one token at a time."""
    kwarg = compat.cache_forward_kwarg(model)
    outs = [model(input_ids=ids[:, :prompt_len], use_cache=True, **{kwarg: cache}).logits]
    for i in range(prompt_len, ids.shape[1]):
        outs.append(model(input_ids=ids[:, i : i + 1], use_cache=True, **{kwarg: cache}).logits)
    return torch.cat(outs, dim=1)

