"""Inference and LoRA with NeuZip weights against bf16 and bitsandbytes, one GPU.

Three parts, all in one process on one card, results in ``benchmarks/decode/results.jsonl#inference``:

1. **Decode** (Llama-3-8B architecture, random N(0, 0.02) init): weight memory, peak memory and greedy
   decode tokens/s at batch 1 and 16 for dense bf16, NeuZip lossless, NeuZip lossy k = 3, 1, 0, and
   bitsandbytes NF4 and INT8 (LLM.int8(), threshold 6). Every variant runs the same loop: one prefill,
   then one token per forward with transformers' ``DynamicCache``, no CUDA graphs, no compile. NeuZip
   rows also carry a profile: the time to decode every matrix once (the per-token cost of decoding).
2. **Perplexity** of lossy against lossless on a small Llama trained here by neutrain (NeuZip-lossless
   weights, fused AdamW in backward) on the Python standard library's sources, bytes as tokens.
3. **LoRA**: adapters on a NeuZip lossy-3 base against QLoRA (NF4 base), same adapters, data, steps and
   loss: loss after N steps on the small trained model (plus a bf16-base reference), and peak memory and
   tokens/s on the 8B architecture.

    python benchmarks/decode/inference.py             # GPU, about 6 minutes on an H100
    python benchmarks/decode/inference.py --tiny      # tiny shapes, CPU smoke test (bitsandbytes rows skipped)

Partial results are written after every measurement, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from benchmarks._common import git_provenance, write_result  # noqa: E402

from benchmarks.memory.train_memory import LLAMA3_8B, TINY as TINY_BIG  # noqa: E402  (the same 8B architecture)

SMALL = dict(vocab_size=256, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False)
TINY_SMALL = dict(SMALL, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
DECODE_VARIANTS = ("dense-bf16", "neuzip-lossless", "neuzip-lossy-3", "bnb-nf4", "bnb-int8", "neuzip-lossy-1",
                   "neuzip-lossy-0")
LORA = {"lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "lora_target_modules": "all-linear"}


class Clock:
    """Seconds left before the run's deadline (sections are skipped rather than cut off)."""

    def __init__(self, budget_s: float):
        self.end = time.perf_counter() + budget_s

    def left(self) -> float:
        return self.end - time.perf_counter()


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free():
    from neutrain.nn import DECODE_BUFFERS

    DECODE_BUFFERS.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gib(nbytes: float) -> float:
    return nbytes / 2**30


def allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


# ----------------------------------------------------------------------------------------------- models
def dense_model(cfg: dict, device: str, seed: int = 0):
    """A bf16 Llama on ``device`` with transformers' N(0, initializer_range) initialisation."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**cfg), dtype=torch.bfloat16)
    return model.eval()


def bnb_quantize_(model, kind: str):
    """Replace every linear layer but the lm_head by bitsandbytes NF4 or INT8, in place (what
    ``from_pretrained(..., quantization_config=BitsAndBytesConfig(...))`` builds, without a disk round trip)."""
    import logging

    import bitsandbytes as bnb

    # LLM.int8() logs a bf16 -> fp16 input cast on every call; once is enough to know.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)

    from neutrain.nn.convert import _set_submodule

    device = next(model.parameters()).device
    head = model.get_output_embeddings()
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear) or module is head:
            continue
        bias = module.bias is not None
        if kind == "nf4":
            new = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=bias, compute_dtype=torch.bfloat16,
                                    quant_type="nf4", device="meta")
            new.weight = bnb.nn.Params4bit(module.weight.data, requires_grad=False, quant_type="nf4",
                                           module=new)._quantize(device)
        else:
            new = bnb.nn.Linear8bitLt(module.in_features, module.out_features, bias=bias, has_fp16_weights=False,
                                      threshold=6.0, device="meta")
            new.weight = bnb.nn.Int8Params(module.weight.data, requires_grad=False,
                                           has_fp16_weights=False)._quantize(device)
        if bias:
            new.bias = module.bias
        _set_submodule(model, name, new)
        module.weight = None
    free()
    return model


def make_variant(variant: str, cfg: dict, device: str):
    """The model for one decode row: dense, NeuZip (compressed in place, head chunked) or bitsandbytes."""
    from neutrain.export.inference import chunk_output_head
    from neutrain.nn.lora import compress_model_for_adapters

    model = dense_model(cfg, device).requires_grad_(False)
    if variant.startswith("neuzip"):
        compress_model_for_adapters(model, variant)
        chunk_output_head(model)
    elif variant.startswith("bnb"):
        bnb_quantize_(model, variant.split("-")[1])
    free()
    return model


# ----------------------------------------------------------------------------------------------- decode
@torch.no_grad()
def decode_rate(model, batch: int, prompt: int, new_tokens: int, warmup: int = 3) -> dict:
    """Greedy decode with a DynamicCache: tokens/s over ``new_tokens`` steps after a prefill, and peak memory."""
    from neutrain import compat

    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, prompt), device=device, generator=torch.Generator(device).manual_seed(1))
    key = compat.cache_forward_kwarg(model)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache = compat.output_cache(out)
    token = out.logits[:, -1:].argmax(-1)
    for step in range(warmup + new_tokens):
        if step == warmup:
            sync()
            start = time.perf_counter()
        out = model(input_ids=token, **{key: cache}, use_cache=True)
        cache = compat.output_cache(out)
        token = out.logits[:, -1:].argmax(-1)
    sync()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    row = {"tokens_per_s": batch * new_tokens / seconds, "ms_per_step": 1e3 * seconds / new_tokens,
           "peak_gib": gib(peak)}
    if torch.cuda.is_available():
        # GPU busy time per step (kernels summed): what the step costs once the host loop is no bottleneck.
        from torch.profiler import ProfilerActivity, profile

        steps = 3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                out = model(input_ids=token, **{key: cache}, use_cache=True)
                cache = compat.output_cache(out)
                token = out.logits[:, -1:].argmax(-1)
            sync()
        busy_us = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages())
        row["gpu_ms_per_step"] = busy_us / 1e3 / steps
        row["gpu_bound_tokens_per_s"] = batch * 1e3 / row["gpu_ms_per_step"]
    return row


def decode_all_weights_ms(model) -> float | None:
    """Profile: GPU time to decode every compressed matrix once (the NeuZip cost of one decode step)."""
    from neutrain.nn import compressed_weights

    weights = compressed_weights(model)
    if not weights or not torch.cuda.is_available():
        return None
    from benchmarks._common import cuda_time_ms

    buffer = torch.empty(max(w.numel for w in weights), dtype=torch.bfloat16, device="cuda")

    def run():
        for w in weights:
            w.ct.decompress(out=buffer[: w.numel].view(w.shape))

    ms = cuda_time_ms(run, warmup=1, iters=3)
    del buffer
    free()
    return ms


def decode_section(args, clock, results, save):
    rows = results.setdefault("decode", {})
    cfg = TINY_BIG if args.tiny else LLAMA3_8B
    for variant in DECODE_VARIANTS:
        if variant in rows:
            continue
        if variant.startswith("bnb") and not torch.cuda.is_available():
            rows[variant] = {"skipped": "bitsandbytes rows need CUDA"}
            continue
        if clock.left() < args.reserve_s:
            rows[variant] = {"skipped": "time budget"}
            continue
        free()
        base = allocated()
        started = time.perf_counter()
        try:
            model = make_variant(variant, cfg, args.device)
            row = {"build_s": time.perf_counter() - started, "weights_gib": gib(allocated() - base),
                   "base_gib": gib(base)}
            for batch in (1, 16):
                rate = decode_rate(model, batch, args.prompt, args.new_tokens)
                rate["peak_gib"] -= gib(base)  # this model's own peak (nothing else should be left)
                row[f"batch{batch}"] = rate
            if variant.startswith("neuzip"):
                row["profile_decode_all_weights_ms"] = decode_all_weights_ms(model)
            if variant in ("neuzip-lossy-3", "bnb-nf4"):
                results.setdefault("lora_8b", {})[variant] = lora_rate(model, args)
        except Exception as exc:  # keep the other rows
            row = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        rows[variant] = row
        model = None
        free()
        print(variant, row, flush=True)
        save()


# ----------------------------------------------------------------------------------------------- data, small model
def stdlib_bytes(limit: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The standard library's .py sources as bytes: (train, lora, held-out) splits by file, 80/10/10."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    files = [f for f in files if "test" not in f.parts and "site-packages" not in f.parts]
    blobs, total = [], 0
    for f in files:
        try:
            data = f.read_bytes()
        except OSError:
            continue
        blobs.append(data)
        total += len(data)
        if total >= limit:
            break
    n = len(blobs)
    parts = (blobs[: int(0.8 * n)], blobs[int(0.8 * n): int(0.9 * n)], blobs[int(0.9 * n):])
    return tuple(torch.frombuffer(bytearray(b"".join(p)), dtype=torch.uint8).long() for p in parts)


def batches(data: torch.Tensor, batch: int, seq: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        yield torch.stack([data[s: s + seq] for s in starts.tolist()])


@torch.no_grad()
def heldout_loss(model, data: torch.Tensor, seq: int, windows: int, device: str) -> float:
    from neutrain.nn import causal_lm_loss

    stride = max(seq, (data.numel() - seq - 1) // windows)
    ids = torch.stack([data[i * stride: i * stride + seq] for i in range(windows)]).to(device)
    losses = [causal_lm_loss(model, chunk, chunk).item() for chunk in ids.split(16)]
    return sum(losses) / len(losses)


def train_small(args, data, device):
    """A small Llama trained by neutrain: NeuZip-lossless weights, fused AdamW inside backward."""
    from neutrain.nn import causal_lm_loss, compress_model
    from neutrain.optim.factory import build_fused_optimizer

    model = dense_model(TINY_SMALL if args.tiny else SMALL, device, seed=3)
    model.train()
    compress_model(model, "neuzip-lossless", progress=False)
    opt = build_fused_optimizer(model, "adamw-in-backward", lr=args.small_lr, weight_decay=0.0, betas=(0.9, 0.95),
                                clip_mode="per_tensor", max_grad_norm=1.0)
    stream = batches(data, args.small_batch, args.seq, seed=0)
    losses, start = [], time.perf_counter()
    for step in range(args.small_steps):
        for group in opt.param_groups:  # cosine to 10 %
            group["lr"] = args.small_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.small_steps)))
        ids = next(stream).to(device)
        loss = causal_lm_loss(model, ids, ids)
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    sync()
    info = {"steps": args.small_steps, "batch": args.small_batch, "seq": args.seq, "loss_first": losses[0],
            "loss_last10": sum(losses[-10:]) / len(losses[-10:]), "train_s": time.perf_counter() - start,
            "params_m": sum(w.numel for w in _weights(model)) / 1e6}
    return model.eval(), info


def _weights(model):
    from neutrain.nn import compressed_weights

    return compressed_weights(model)


def perplexity_section(args, data, model, results):
    """Held-out perplexity of the trained model with every matrix re-rounded to k mantissa bits."""
    from neutrain.compress import compress
    from neutrain.export.hf import densify

    _, _, heldout = data
    windows = 16 if args.tiny else 256
    lossless = heldout_loss(model, heldout, args.seq, windows, args.device)
    dense = densify(model).to(args.device)
    dense_loss = heldout_loss(dense, heldout, args.seq, windows, args.device)
    del dense
    rows = {"neuzip-lossless": {"loss": lossless, "perplexity": math.exp(lossless)},
            "dense-bf16": {"loss": dense_loss, "perplexity": math.exp(dense_loss)}}
    originals = {id(w): w.ct for w in _weights(model)}
    for k in (3, 1, 0):
        for w in _weights(model):
            w.replace_(compress(originals[id(w)].decompress(), k, name=w.name))
        loss = heldout_loss(model, heldout, args.seq, windows, args.device)
        rows[f"neuzip-lossy-{k}"] = {"loss": loss, "perplexity": math.exp(loss),
                                     "perplexity_change_pct": 100 * (math.exp(loss - lossless) - 1)}
    for w in _weights(model):
        w.replace_(originals[id(w)])
    results["perplexity"] = {"windows": windows, "seq": args.seq, "rows": rows}


# ----------------------------------------------------------------------------------------------- LoRA
def lora_train(model, stream, steps: int, lr: float, device: str) -> dict:
    """Train LoRA adapters on ``model`` (base frozen) with AdamW; loss curve, tokens/s and peak memory."""
    from neutrain.nn.lora import apply_lora
    from neutrain.nn import causal_lm_loss

    peft_model = apply_lora(model.requires_grad_(False), LORA)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    peft_model.train()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    losses, tokens, start = [], 0, None
    for step in range(steps):
        if step == min(2, steps - 1):
            sync()
            start, tokens = time.perf_counter(), 0
        ids = next(stream).to(device)
        loss = causal_lm_loss(peft_model, ids, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        tokens += ids.numel()
    sync()
    out = {"steps": steps, "loss_first": losses[0], "loss_last": losses[-1],
           "loss_last10": sum(losses[-10:]) / len(losses[-10:]),
           "tokens_per_s": tokens / (time.perf_counter() - start),
           "peak_gib": gib(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None,
           "adapter_params_m": sum(p.numel() for p in params) / 1e6}
    return out, peft_model


def lora_rate(model, args) -> dict:
    """LoRA steps on the 8B-architecture model in place (random tokens): peak memory and tokens/s."""
    gen = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size

    def stream():
        while True:
            yield torch.randint(0, vocab, (args.lora_batch, args.lora_seq), generator=gen)

    try:
        out, _ = lora_train(model, stream(), args.lora_8b_steps, 2e-4, args.device)
        return out
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def lora_section(args, data, trained, results):
    """LoRA on the small trained model: bf16 base, NeuZip lossy-3 base, NF4 base (QLoRA); same everything else."""
    from neutrain.export.hf import densify
    from neutrain.nn.lora import compress_model_for_adapters

    _, lora_data, heldout = data
    rows = {}
    for base in ("bf16", "neuzip-lossy-3", "neuzip-lossy-3-layers", "bnb-nf4"):
        if base == "bnb-nf4" and not torch.cuda.is_available():
            rows[base] = {"skipped": "bitsandbytes needs CUDA"}
            continue
        free()
        model = densify(trained).to(args.device)
        if base == "neuzip-lossy-3-layers":
            # As QLoRA keeps embeddings and lm_head in bf16: those stay lossless, decoder matrices lossy-3.
            from neutrain.compress import compress

            compress_model_for_adapters(model, "neuzip-lossless")
            for w in _weights(model):
                if not w.large:
                    w.replace_(compress(w.dense(), 3, name=w.name))
        elif base.startswith("neuzip"):
            compress_model_for_adapters(model, base)
        elif base == "bnb-nf4":
            bnb_quantize_(model, "nf4")
        before = heldout_loss(model, heldout, args.seq, 32, args.device)
        try:
            row, peft_model = lora_train(model, batches(lora_data, args.small_batch, args.seq, seed=7),
                                         args.lora_steps, args.lora_lr, args.device)
            row["heldout_loss_before"] = before
            row["heldout_loss_after"] = heldout_loss(peft_model.eval(), heldout, args.seq, 32, args.device)
        except Exception as exc:
            row = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        rows[base] = row
        model = peft_model = None
        print("lora", base, row, flush=True)
    results["lora_small"] = {"settings": {**LORA, "steps": args.lora_steps, "lr": args.lora_lr,
                                          "batch": args.small_batch, "seq": args.seq}, "rows": rows}


# ----------------------------------------------------------------------------------------------- summary
def headline(results: dict) -> str:
    parts = []
    dec = results.get("decode", {})
    dense = dec.get("dense-bf16", {})
    lossless = dec.get("neuzip-lossless", {})
    if "weights_gib" in dense and "weights_gib" in lossless and dense["batch1"]["peak_gib"] > 0:
        parts.append(f"NeuZip lossless peak {lossless['batch1']['peak_gib']:.2f} vs bf16 "
                     f"{dense['batch1']['peak_gib']:.2f} GiB "
                     f"({lossless['batch1']['peak_gib'] / dense['batch1']['peak_gib']:.2f}x), decode "
                     f"{lossless['batch1']['tokens_per_s'] / dense['batch1']['tokens_per_s']:.2f}x bf16 at batch 1, "
                     f"{lossless['batch16']['tokens_per_s'] / dense['batch16']['tokens_per_s']:.2f}x at 16 "
                     f"(eager loop)")
        if "gpu_ms_per_step" in lossless["batch1"]:
            parts.append(f"GPU time per step {lossless['batch1']['gpu_ms_per_step']:.1f} vs "
                         f"{dense['batch1']['gpu_ms_per_step']:.1f} ms "
                         f"({dense['batch1']['gpu_ms_per_step'] / lossless['batch1']['gpu_ms_per_step']:.2f}x when "
                         f"GPU-bound)")
    ppl = results.get("perplexity", {}).get("rows", {})
    if "neuzip-lossy-3" in ppl:
        parts.append(f"lossy-3 perplexity {ppl['neuzip-lossy-3']['perplexity_change_pct']:+.2f}% vs lossless")
    lora = results.get("lora_small", {}).get("rows", {})
    if "loss_last10" in lora.get("neuzip-lossy-3", {}) and "loss_last10" in lora.get("bnb-nf4", {}):
        parts.append(f"LoRA loss lossy-3 {lora['neuzip-lossy-3']['loss_last10']:.3f} vs QLoRA NF4 "
                     f"{lora['bnb-nf4']['loss_last10']:.3f}")
    return "; ".join(parts) or "see JSON"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and few steps (CPU smoke test)")
    ap.add_argument("--budget-s", type=float, default=420, help="skip what would not finish within this time")
    ap.add_argument("--reserve-s", type=float, default=25, help="time a decode row needs at least")
    ap.add_argument("--out-name", default="inference")
    args = ap.parse_args()
    git_provenance()  # fail now, not after the measurement, if the commit cannot be recorded
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    tiny = args.tiny
    args.prompt, args.new_tokens = (8, 4) if tiny else (64, 32)
    args.seq = 32 if tiny else 256
    args.small_steps, args.small_batch, args.small_lr = (4, 4, 3e-3) if tiny else (300, 32, 3e-3)
    args.lora_steps, args.lora_lr = (4, 1e-3) if tiny else (100, 1e-3)
    args.lora_batch, args.lora_seq, args.lora_8b_steps = (2, 16, 3) if tiny else (2, 512, 6)
    clock = Clock(args.budget_s)
    settings = {k: v for k, v in vars(args).items()}
    settings.update(big_config=TINY_BIG if tiny else LLAMA3_8B, small_config=TINY_SMALL if tiny else SMALL,
                    decode_loop="prefill + greedy steps, transformers DynamicCache, eager (no CUDA graphs, no compile)")
    results: dict = {}

    def save():
        results["headline"] = headline(results)
        write_result(args.out_name, settings, results)

    data = stdlib_bytes(400_000 if tiny else 12_000_000)
    settings["corpus_bytes"] = [int(d.numel()) for d in data]
    trained, info = train_small(args, data[0], args.device)
    results["small_model"] = info
    print("small model", info, flush=True)
    perplexity_section(args, data, trained, results)
    print("perplexity", results["perplexity"], flush=True)
    save()
    lora_section(args, data, trained, results)
    trained = None
    save()
    decode_section(args, clock, results, save)
    save()
    print(results["headline"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
