"""Speculative generate on a NeuZip-compressed target (neutrain.nn.compress_model)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from neutrain.nn import compress_model
from neutrain.speculative import generate


@pytest.mark.slow
@pytest.mark.parametrize("engine", [False, True])  # DynamicCache, or device-resident rounds on static caches
def test_greedy_on_compressed_target_equals_dense_greedy(engine):
    cfg = LlamaConfig(vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    target = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    target.load_state_dict(dense.state_dict())
    report = compress_model(target, progress=False)
    assert report.converted > 0 and type(target.lm_head).__name__ == "CompressedLinear"
    torch.manual_seed(1)
    draft = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2)).eval()
    prompt = torch.tensor([[3, 7, 9, 11]])
    with torch.no_grad():
        reference = dense.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    out = generate(target, draft, prompt, num_drafts=2, draft_len=3, temperature=0, max_new_tokens=8,
                   engine=engine)
    assert torch.equal(out.sequences, reference)
