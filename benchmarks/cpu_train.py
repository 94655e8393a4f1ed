"""CPU training tokens/s, compressed (NeuZip lossless) over dense, both with fused AdaLomo.

The default recipe's model (``recipes/default.yaml``: Llama, hidden 256, 4 layers, vocabulary 4096,
tied embedding) and its optimizer (AdaLomo, lr 0.1, weight decay 0.01, stochastic rounding,
per-tensor clipping at 1.0), 8 x 256 tokens a step, bf16 weights, in one process:

* ``dense``: bf16 parameters, fused AdaLomo through its hooks;
* ``compressed``: the same model converted (``compress_model``), decoded weights kept from forward to
  the update within the CPU keep budget (``neutrain.nn.buffers``, the default);
* ``compressed_slots``: the same, with the keep budget at 0 (the shared decode slots only: how every
  decode ran before kept decodes existed), so the change is measured against its own baseline.

The machine is shared: the variants run in interleaved blocks of ``--steps`` steps, the block order
rotating each repeat, and every step is timed alone; the result is the median step's tokens/s per
variant, the ratio of medians, the median of the per-repeat ratios, and the load average around each
block. The models train on the same batches, so the compressed ones must end bit-identical to dense
(``bit_identical``, checked at the end). Decodes per weight per step count full decodes
(``CompressedWeight.decodes``) over the timed steps.

    python benchmarks/cpu_train.py --steps 5 --repeats 4

Measured at 6759479 (``results/cpu_train.json``; 2 shared cores, avx512_bf16): in a quiet spell
(load 2.07-2.09, this benchmark's own two threads) dense 8,716 tok/s, compressed 7,567 (0.868),
compressed with the slots only 7,207 (0.827); 1.0 against 1.9 decodes per weight per step (the
embedding's are fewer: its forward reads rows). Under load 4.3-6.6 the medians scatter by +-10%
(0.90/0.77, then 0.94/0.96): the kept decodes' gain is about the size of that noise. The CLI
(``python -m neutrain recipes/default.yaml memory.weights=X train.max_steps=20 eval.perplexity=false
export.format=none distill.enabled=false eval.sample_tokens=1``, three interleaved rounds, load
1.6-2.0): dense 8,238 / 9,646 / 8,177, compressed 8,062 / 8,265 / 8,540, slots only
(``NEUTRAIN_KEEP_DECODED_MIB=0``) 8,047 / 8,209 / 7,544 tok/s: medians 1.00 and 0.98 of dense.
The 0.70 in ``notes_codec.md`` (dense 2,166 tok/s there) was measured under load.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import git_provenance, write_result  # noqa: E402

VARIANTS = ("dense", "compressed", "compressed_slots")
OPTIMIZER = {"lr": 0.1, "weight_decay": 0.01, "stochastic_rounding": True, "clip_mode": "per_tensor",
             "max_grad_norm": 1.0, "seed": 42}


def _models() -> dict[str, torch.nn.Module]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from neutrain.config import load_recipe
    from neutrain.nn import compress_model

    recipe = load_recipe("default")
    config = LlamaConfig(**{k: v for k, v in recipe.model["config"].items() if k != "model_type"},
                         vocab_size=recipe.model["tokenizer_vocab_size"])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).train()
    models = {"dense": dense}
    for name in VARIANTS[1:]:
        models[name] = copy.deepcopy(dense)
        compress_model(models[name], progress=False)
    return models


def _keep(name: str) -> None:
    """The keep budget each variant runs under (kept buffers are made at a weight's first decode)."""
    from neutrain.nn import DECODE_BUFFERS
    from neutrain.nn.buffers import default_keep_bytes

    cpu = torch.device("cpu")
    DECODE_BUFFERS.keep_bytes[cpu] = 0 if name == "compressed_slots" else default_keep_bytes(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per block")
    parser.add_argument("--repeats", type=int, default=4, help="blocks per variant")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    git_provenance()  # fail before measuring if the commit cannot be recorded

    from neutrain.compat.cpu_features import native_bf16_feature
    from neutrain.nn import causal_lm_loss, compressed_weights, decompressed_state_dict
    from neutrain.optim import AdaLomo

    models = _models()
    opts = {name: AdaLomo(m.parameters(), **OPTIMIZER).bind(m) for name, m in models.items()}
    vocab = models["dense"].config.vocab_size
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, vocab, (args.batch, args.seq), generator=g) for _ in range(args.steps)]
    tokens = args.batch * args.seq
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    decodes: dict[str, int] = {name: 0 for name in VARIANTS[1:]}
    blocks = []

    def block(name: str, timed: bool) -> float:
        _keep(name)
        model, opt = models[name], opts[name]
        before = sum(w.decodes for w in compressed_weights(model))
        spent = []
        for ids in batches:
            start = time.perf_counter()
            opt.backward(causal_lm_loss(model, ids, ids))
            opt.step()
            spent.append(time.perf_counter() - start)
        if timed:
            times[name] += spent
            if name in decodes:
                decodes[name] += sum(w.decodes for w in compressed_weights(model)) - before
        return sum(spent)

    for name in VARIANTS:  # warm-up block: buffers, kernels, optimizer state
        block(name, timed=False)
    for repeat in range(args.repeats):
        order = VARIANTS[repeat % 3:] + VARIANTS[:repeat % 3]
        row = {"order": list(order), "load_before": os.getloadavg()[0]}
        for name in order:
            row[f"{name}_tok_s"] = round(tokens * args.steps / block(name, timed=True), 1)
        row["load_after"] = os.getloadavg()[0]
        blocks.append(row)
        print(row, flush=True)

    dense_w = decompressed_state_dict(models["dense"])
    identical = {name: all(torch.equal(dense_w[k], v) for k, v in decompressed_state_dict(models[name]).items())
                 for name in VARIANTS[1:]}
    med = {name: tokens / median(times[name]) for name in VARIANTS}
    n_weights = len(compressed_weights(models["compressed"]))
    timed_steps = args.steps * args.repeats
    per_repeat = [b["compressed_tok_s"] / b["dense_tok_s"] for b in blocks]
    results = {
        "median_tok_s": {k: round(v, 1) for k, v in med.items()},
        "compressed_over_dense": round(med["compressed"] / med["dense"], 3),
        "compressed_slots_over_dense": round(med["compressed_slots"] / med["dense"], 3),
        "compressed_over_dense_per_repeat_median": round(median(per_repeat), 3),
        "decodes_per_weight_per_step": {k: round(v / n_weights / timed_steps, 2) for k, v in decodes.items()},
        "compressed_weights": n_weights,
        "bit_identical_to_dense": identical,
        "load_average": {"min": min(min(b["load_before"], b["load_after"]) for b in blocks),
                         "max": max(max(b["load_before"], b["load_after"]) for b in blocks)},
        "blocks": blocks,
    }
    settings = {"model": "recipes/default.yaml (hidden 256, 4 layers, vocab 4096, tied)", "dtype": "bfloat16",
                "batch": args.batch, "seq": args.seq, "steps_per_block": args.steps, "repeats": args.repeats,
                "optimizer": {"name": "adalomo", **OPTIMIZER}, "threads": torch.get_num_threads(),
                "cpu_native_bf16": native_bf16_feature(), "cpu_count": os.cpu_count()}
    targets = {"cpu_compressed_over_dense_fused": {"value": results["compressed_over_dense"], "goal": 0.8}}
    print(write_result("cpu_train", settings, results, targets=targets))
    print({k: v for k, v in results.items() if k != "blocks"})


if __name__ == "__main__":
    main()
