"""LoRA setup on a compressed base decodes nothing (it once took 17 minutes before step 1 on a 135M model).

peft reads ``.weight`` of each layer it wraps for its device; on a compressed module that read was a
full decode. Inside ``shape_only_weights`` it is a shape-only stand-in that refuses value reads.
"""

import pytest
import torch

from neutrain.compress import CompressedTensor
from neutrain.nn.lora import apply_lora, compress_model_for_adapters, load_adapters
from neutrain.nn import CompressedLinear
from neutrain.nn.stand_in import WeightStandIn, shape_only_weights


def _compressed_base(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return compress_model_for_adapters(LlamaForCausalLM(config).to(torch.bfloat16).eval(), "neuzip-lossless")


@pytest.fixture
def decodes(monkeypatch):
    """Counts full decodes of any compressed tensor."""
    calls = []
    original = CompressedTensor.decompress

    def counting(self, *args, **kwargs):
        calls.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CompressedTensor, "decompress", counting)
    return calls


def test_lora_setup_and_adapter_loading_decode_no_weight(tmp_path, decodes):
    base = _compressed_base()
    ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        expected = base(ids).logits
    decodes.clear()
    model = apply_lora(base, {"lora_r": 4, "lora_alpha": 8})
    assert decodes == [], f"apply_lora decoded {len(decodes)} weights"
    wrapped = model.base_model.model.model.layers[0].mlp.up_proj
    assert isinstance(wrapped.get_base_layer(), CompressedLinear) and "default" in wrapped.lora_A
    with torch.no_grad():  # B starts at zero: the wrapped model is the base model
        assert torch.equal(model(ids).logits, expected)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.01)
    model.save_pretrained(str(tmp_path / "adapters"))
    fresh = _compressed_base()
    decodes.clear()
    loaded = load_adapters(fresh, tmp_path / "adapters")
    assert decodes == [], f"load_adapters decoded {len(decodes)} weights"
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_stand_in_has_the_metadata_and_refuses_values():
    layer = _compressed_base().model.layers[0].self_attn.q_proj
    with shape_only_weights():
        w = layer.weight
        assert isinstance(w, WeightStandIn)
        assert (w.shape, w.dtype, w.device, w.dim(), w.numel()) == (torch.Size([64, 64]), torch.bfloat16,
                                                                    torch.device("cpu"), 2, 4096)
        for read in (lambda: w + 1, lambda: w.sum(), lambda: w.float(), lambda: w.clone(), lambda: w @ w.T):
            with pytest.raises(RuntimeError, match="values were read inside shape_only_weights"):
                read()
    dense = layer.weight  # outside: the decoded weight again
    assert type(dense) is torch.Tensor and torch.equal(dense, layer.compressed.dense())
