"""Is a GPU training run reproducible, and what do deterministic kernels cost? (``train.deterministic``)

Two parts, on one CUDA GPU:

* **repeat**: Llama-3-8B widths (hidden 4096, 32 heads of 128, 8 KV heads, vocabulary 128,256) with 2
  decoder layers, NeuZip-lossless, LOMO lr 1e-3 with a per-tensor clip 1.0 and stochastic rounding off,
  activation checkpointing, 1,024 tokens a step (the 8B recipe's step). For each kernel mode
  (PyTorch's default, ``deterministic``), placement (weights and checkpointed inputs offloaded, or all on
  the GPU) and row layout (one sequence, or two packed documents, which gives attention a mask), it trains
  4 steps twice and once resumed from a checkpoint saved at step 2, and counts the blobs (of 133) in
  which the second run and the resume differ from the first.
* **timing**: forward and backward of 4 Llama-3-8B decoder layers (no checkpointing), default kernels
  against deterministic ones, at 1 x 1,024, 8 x 1,024 and 1 x 16,384 tokens (one sequence, two documents, or
  documents of 2,048 tokens), under ``sdpa`` and ``neutrain_sdpa``; its targets: at 16K packed,
  ``neutrain_sdpa``'s deterministic step within 1.25x of ``sdpa``'s default, and its default step faster.

Writes ``benchmarks/training/results.jsonl#determinism`` (and ``$OUT/determinism.json``). About 4 minutes on an H100/H200.

    python benchmarks/training/determinism.py                 # both parts
    python benchmarks/training/determinism.py --part timing
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from benchmarks._common import write_result  # noqa: E402 (after the path is set)
from neutrain.trainer.determinism import deterministic_kernels  # noqa: E402

TOKENS, STEPS, SAVED_AT = 1024, 4, 2


def llama_config(layers: int, vocab: int, hidden: int = 4096, heads: int = 32, kv_heads: int = 8):
    """A Llama config of Llama-3-8B's widths (by default) with ``layers`` decoder layers, SDPA attention."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 7 // 2,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         rope_theta=5e5, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return config


def _positions(rows: int, tokens: int, packed: bool) -> torch.Tensor | None:
    """Packed rows: two documents per row whose positions restart (transformers then builds a mask)."""
    return torch.arange(tokens // 2).repeat(2).repeat(rows, 1).cuda() if packed else None


def train_steps(config, batches: list[torch.Tensor], offload: bool, packed: bool, start: int = 0,
                resume_from=None, save_to=None, saved_at: int = SAVED_AT) -> dict[str, torch.Tensor]:
    """Steps ``start``.. of ``batches`` (one ``[1, tokens]`` CUDA tensor each) on a fresh compressed model (loaded
    from the checkpoint ``resume_from``, if given; saved to ``save_to`` after ``saved_at`` steps): the 8B
    recipe's update (LOMO lr 1e-3, per-tensor clip 1.0, no stochastic rounding, checkpointing), with the
    decoder's weights and checkpointed inputs in host memory when ``offload``. Returns its blobs, on the host."""
    from neutrain.nn import causal_lm_loss
    from neutrain.nn.checkpoint import load_compressed_state, save_compressed_checkpoint
    from neutrain.nn.load import init_compressed
    from neutrain.nn.offload import offload_checkpointed_inputs
    from neutrain.nn.weight_offload_model import offload_weights
    from neutrain.optim import LOMO

    model, _ = init_compressed(config, "neuzip-lossless", "cuda", seed=0, progress=False)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    if offload:
        offload_weights(model)
        offload_checkpointed_inputs(model)
    if resume_from is not None:
        load_compressed_state(model, resume_from)
    opt = LOMO(model.parameters(), lr=1e-3, clip_mode="per_tensor", max_grad_norm=1.0,
               stochastic_rounding=False).bind(model)
    positions = _positions(1, batches[0].shape[1], packed)
    for step in range(start, len(batches)):
        ids = batches[step]
        opt.backward(causal_lm_loss(model, ids, ids, **({"position_ids": positions} if packed else {})))
        opt.step()
        if save_to is not None and step + 1 == saved_at:
            save_compressed_checkpoint(model, save_to, "neuzip-lossless")
    blobs = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return blobs


def token_batches(vocab: int, tokens: int = TOKENS, steps: int = STEPS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (1, tokens), generator=g).cuda() for _ in range(steps)]


def repeat() -> list[dict]:
    config, batches = llama_config(2, 128256), token_batches(32000)  # the recipe's tokenizer: 32,000 tokens
    rows = []
    for deterministic in (False, True):
        for offload in (True, False):
            for packed in (False, True):
                with tempfile.TemporaryDirectory() as ckpt, deterministic_kernels(deterministic):
                    first = train_steps(config, batches, offload, packed, save_to=ckpt)
                    again = train_steps(config, batches, offload, packed)
                    resumed = train_steps(config, batches, offload, packed, start=SAVED_AT, resume_from=ckpt)
                row = {"deterministic": deterministic, "offload": offload, "packed": packed, "blobs": len(first),
                       "rerun_differs": sum(not torch.equal(first[k], again[k]) for k in first),
                       "resume_differs": sum(not torch.equal(first[k], resumed[k]) for k in first)}
                print(row, flush=True)
                rows.append(row)
    return rows


def timing() -> list[dict]:
    """Forward and backward of 4 decoder layers, default against deterministic kernels, under transformers' ``sdpa``
    (packed rows: a block-diagonal mask) and ``neutrain_sdpa`` (packed rows one document at a time: variable-length
    flash), one row layout after another: one sequence, two documents, and documents of 2,048 tokens."""
    from transformers import AutoModel

    from neutrain.attention.packed import register

    model = AutoModel.from_config(llama_config(4, 1024), dtype=torch.bfloat16).cuda().train()
    model.config.use_cache = False
    names = ("sdpa", register())

    def step_ms(rows: int, tokens: int, documents: int, deterministic: bool, attn: str) -> float:
        model.config._attn_implementation = attn
        ids = torch.randint(0, 1024, (rows, tokens), device="cuda")
        positions = None if documents == 1 else \
            torch.arange(tokens // documents, device="cuda").repeat(documents).repeat(rows, 1)
        with deterministic_kernels(deterministic):
            for i in range(8):
                if i == 3:  # three warm-up steps
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                model(input_ids=ids, position_ids=positions).last_hidden_state.float().square().mean().backward()
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / 5 * 1000

    out = []
    for rows, tokens in ((1, 1024), (8, 1024), (1, 16384)):
        for documents in sorted({1, 2, max(tokens // 2048, 1)}):
            for attn in names:
                # Alternated, best of two each: a clock or neighbour drift hits both modes alike.
                runs = [step_ms(rows, tokens, documents, d, attn) for d in (False, True, False, True)]
                default, deterministic = min(runs[0], runs[2]), min(runs[1], runs[3])
                row = {"rows": rows, "tokens": tokens, "documents": documents, "packed": documents > 1,
                       "attention": attn, "default_ms": round(default, 1), "deterministic_ms": round(deterministic, 1),
                       "ratio": round(deterministic / default, 3)}
                print(row, flush=True)
                out.append(row)
    return out


def timing_targets(rows: list[dict]) -> dict:
    """At 16K tokens in packed rows: neutrain_sdpa's deterministic step against sdpa's default one (goal: at most
    1.25x, so an exact resume costs little), and neutrain_sdpa's default against sdpa's (goal: faster)."""
    targets = {}
    for documents in sorted({r["documents"] for r in rows if r["tokens"] == 16384 and r["packed"]}):
        pick = {r["attention"]: r for r in rows if r["tokens"] == 16384 and r["documents"] == documents}
        if {"sdpa", "neutrain_sdpa"} <= set(pick):
            base = pick["sdpa"]["default_ms"]
            targets[f"packed_16k_{documents}_docs_deterministic_over_sdpa_default"] = {
                "value": round(pick["neutrain_sdpa"]["deterministic_ms"] / base, 3), "goal": "<= 1.25"}
            targets[f"packed_16k_{documents}_docs_neutrain_sdpa_speedup"] = {
                "value": round(base / pick["neutrain_sdpa"]["default_ms"], 3), "goal": ">= 1.0"}
    return targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("repeat", "timing", "both"), default="both")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/training/determinism.py: needs a CUDA GPU")
    results = {"device": torch.cuda.get_device_name()}
    if args.part in ("repeat", "both"):
        results["repeat"] = repeat()
    targets = {}
    if args.part in ("timing", "both"):
        results["timing"] = timing()
        targets = timing_targets(results["timing"])
    write_result("determinism", {"tokens": TOKENS, "steps": STEPS, "saved_at": SAVED_AT, "part": args.part}, results,
                 targets=targets)


if __name__ == "__main__":
    main()
