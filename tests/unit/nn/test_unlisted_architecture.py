"""A transformers architecture with the standard layout trains compressed with no line of neutrain naming it.

neutrain describes no architecture by name: the build reads the skeleton transformers makes from the config and
puts each checkpoint tensor where transformers' own loader would (:mod:`neutrain.nn.checkpoint_keys`), and
:mod:`neutrain.nn.architecture` checks what an architecture adds beyond plain linears and embeddings on the
built modules themselves. Helium (Kyutai) is in none of neutrain's tables nor in the architecture matrix
(tests/integration/test_architectures.py): saved by transformers, it builds compressed through the one build
path, computes the dense model's loss, and a fused step leaves it where the dense model's step does.
"""

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import neutrain
from neutrain.nn import causal_lm_loss, compressed_weights, decompressed_state_dict
from neutrain.nn.formats import load_compressed
from neutrain.optim import AdaLomo

ARCHITECTURE = "helium"
CONFIG = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "pad_token_id": 0, "bos_token_id": 1,
          "eos_token_id": 2}


def _optimizer(model):
    return AdaLomo(model.parameters(), lr=2e-2, clip_mode="per_tensor", max_grad_norm=1.0,
                   stochastic_rounding=False).bind(model)


def test_the_architecture_is_named_nowhere_in_neutrain():
    root = Path(neutrain.__file__).parent
    naming = [str(p.relative_to(root)) for p in root.rglob("*.py") if ARCHITECTURE in p.read_text(encoding="utf-8").lower()]
    assert not naming, f"{ARCHITECTURE} is named in {naming}: this test no longer shows an unlisted architecture"


def test_an_unlisted_standard_architecture_builds_compressed_and_trains(tmp_path):
    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(AutoConfig.for_model(ARCHITECTURE, **CONFIG), dtype=torch.bfloat16)
    dense.save_pretrained(tmp_path)
    compressed, _ = load_compressed(tmp_path, device="cpu", dtype=torch.bfloat16, progress=False,
                                    codec_options={"steps": 16})
    assert type(compressed).__name__ == "HeliumForCausalLM"
    names = {w.name for w in compressed_weights(compressed)}
    assert "model.layers.1.self_attn.q_proj.weight" in names and "lm_head.weight" in names

    ids = torch.randint(3, CONFIG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (dense, compressed):
        model.train()
        opt = _optimizer(model)
        loss = causal_lm_loss(model, ids, ids)  # forward; the fused backward updates each weight as it goes
        opt.backward(loss)
        opt.step()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    want, got = dense.state_dict(), decompressed_state_dict(compressed)
    assert all(torch.equal(want[k], got[k]) for k in got), "a step moved the compressed model elsewhere"
