"""``load_checkpoint_model`` returns its model on the CPU for every saved format, on a machine with a GPU too.

Why: a NeuZip export loads through transformers and neutrain's quantizer, whose own default (as bitsandbytes')
is the current GPU. On a GPU machine the export's model came back on the GPU where the function promises the CPU:
``neutrain generate --device cpu`` ignored the flag for such an export, and the placement tests, run on an H200,
compared a GPU model's logits with a CPU one's. The GPU is stood in for here by saying one is available: a
loader that consults it tries to place the weights there and fails on this CPU machine.
"""

from pathlib import Path

import pytest
import torch

import neutrain  # noqa: F401  (registers the quantizer)
from neutrain.export import load_checkpoint_model
from neutrain.export.neuzip import export_neuzip


def _tiny():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=96, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


@pytest.mark.parametrize("saved", ["neuzip", "neuzip-lossy", "dense"])
def test_the_model_comes_back_on_the_cpu_though_a_gpu_is_visible(tmp_path, monkeypatch, saved):
    model = _tiny()
    if saved == "dense":
        model.save_pretrained(str(tmp_path / "m"))
        path = tmp_path / "m"
    else:
        path = Path(export_neuzip(model, tmp_path / "m", mantissa_bits=3 if saved == "neuzip-lossy" else None,
                                  codec_options={"steps": 8}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    loaded, _ = load_checkpoint_model(path)
    devices = {p.device.type for p in loaded.parameters()} | {b.device.type for b in loaded.buffers()}
    assert devices == {"cpu"}
