"""The static-cache adapter: what the decode engine relies on in transformers' ``StaticCache``."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

from neutrain.compat import cache_forward_kwarg
from neutrain.compat.static_cache import (
    new_static_cache,
    set_static_cache_length,
    static_cache_length,
    static_cache_tensors,
)


def _llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    return AutoModelForCausalLM.from_config(cfg).eval()


def test_layers_are_allocated_up_front_and_the_length_advances_in_place():
    model = _llama()
    cache = new_static_cache(model, batch=2, max_len=16, dtype=torch.float32, device=torch.device("cpu"))
    tensors = static_cache_tensors(cache)
    assert len(tensors) == 2 and all(k.shape == v.shape == (2, 2, 16, 8) for k, v in tensors)
    length = static_cache_length(cache)
    assert length.dim() == 0 and int(length) == 0
    with torch.no_grad():
        model(input_ids=torch.ones(2, 3, dtype=torch.long), use_cache=True, **{cache_forward_kwarg(model): cache})
    # The same tensor object changed (a captured CUDA graph reads it on every replay) ...
    assert static_cache_length(cache) is length and int(length) == 3
    # ... and the keys landed at positions 0..2 of the preallocated tensors, not in new ones.
    assert static_cache_tensors(cache)[0][0] is tensors[0][0]
    assert tensors[0][0][:, :, :3].abs().sum() > 0 and tensors[0][0][:, :, 3:].abs().sum() == 0
    set_static_cache_length(cache, 1)
    assert all(int(layer.cumulative_length) == 1 for layer in cache.layers)
    set_static_cache_length(cache, torch.tensor(5))
    assert int(static_cache_length(cache)) == 5


def test_sliding_window_layers_are_refused():
    cfg = MistralConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=4)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(ValueError, match="full-attention layers only"):
        new_static_cache(model, batch=1, max_len=16, dtype=torch.float32, device=torch.device("cpu"))
