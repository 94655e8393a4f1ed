"""Benchmark: distilled drafts and exact multi-draft speculative decoding.

Everything is trained inside this one run, because GPU hosts start bare:

1. The default corpus (the Python standard library's sources, neutrain.data's
   ``python-stdlib``; files flagged held-out are kept for evaluation) is
   tokenised with a BPE trained on the spot.
2. A target Llama (~100M parameters by default) is trained for a fixed time.
3. Two drafts of the same shape see the same number of tokens: a *control*
   trained with cross-entropy on the corpus, and a *distilled* one trained on
   the target's distributions (forward KL by default; DistillSpec), with a share of
   on-policy sequences sampled from the draft itself.
4. Acceptance ``alpha`` of both drafts on held-out text at temperature 1 and 0.
5. Decoding of held-out prompts at temperature 0 and 1: plain autoregressive
   (HF ``generate``), HF assisted generation (``assistant_model``) with the
   distilled draft, and neutrain's single-draft and K = 2, 4 multi-draft
   schemes with the same draft. Reported: acceptance, block efficiency (tokens
   per target call) and wall-clock tokens/s. ``--engine`` adds the
   :class:`~neutrain.speculative.engine.DecodeEngine`'s autoregressive decode (static
   cache, CUDA graph per token on a GPU) and runs neutrain's schemes on static caches.

Run: ``NEUTRAIN_GIT_COMMIT=$(git rev-parse HEAD) PYTHONPATH=. python
benchmarks/speculative.py`` on the GPU host (it has no ``.git``, so the commit
comes from the environment); ``--quick`` is a CPU smoke test with tiny sizes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import git_provenance, write_result  # noqa: E402
from neutrain.data import python_stdlib_corpus, train_bpe_tokenizer  # noqa: E402
from neutrain.speculative import generate  # noqa: E402
from neutrain.speculative.engine import DecodeEngine  # noqa: E402
from neutrain.distill.losses import acceptance_rate, token_divergence  # noqa: E402


def log(*args):
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


def build_corpus(cache_dir: str, vocab_size: int, max_files: int | None):
    rows = [json.loads(line) for line in open(python_stdlib_corpus(cache_dir, max_files=max_files), encoding="utf-8")]
    train_texts = [r["text"] for r in rows if not r["heldout"]]
    held_texts = [r["text"] for r in rows if r["heldout"]]
    tok = train_bpe_tokenizer(train_texts, vocab_size=vocab_size)
    eos = tok.eos_token_id

    def stream(texts):
        ids = []
        for enc in tok(texts)["input_ids"]:
            ids.extend(enc + [eos])
        return torch.tensor(ids, dtype=torch.long)

    return tok, stream(train_texts), stream(held_texts), [tok(t)["input_ids"] for t in held_texts]


def make_llama(vocab, hidden, layers, heads, kv_heads, inter, device, seed):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def batches(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, stream.numel() - seq - 1, (batch,), generator=gen)
        yield torch.stack([stream[s : s + seq] for s in starts])


def autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)


def train(model, data, steps=None, seconds=None, lr=1e-3, device=None, loss_fn=None, label=""):
    """AdamW with warm-up and cosine decay; stops after ``steps`` or ``seconds``. Returns (steps, tokens)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95), fused=device.type == "cuda")
    model.train()
    start, step, tokens = time.time(), 0, 0
    horizon = steps or 10**9
    while True:
        if steps is not None and step >= steps:
            break
        if seconds is not None and time.time() - start > seconds:
            break
        ids = next(data).to(device)
        frac = step / horizon if steps else min((time.time() - start) / seconds, 1.0)
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        with autocast(device):
            loss = loss_fn(model, ids) if loss_fn else model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += ids.numel()
        if step % 200 == 0:
            log(f"{label} step {step} loss {loss.item():.3f} ({time.time() - start:.0f}s)")
    model.eval()
    return step, tokens, float(loss.item())


def distill_loss_fn(target, divergence, on_policy_every, sample_len):
    """Loss on the target's distributions; every ``on_policy_every`` steps the sequence tail is draft-sampled."""
    state = {"step": 0}

    def loss_fn(draft, ids):
        state["step"] += 1
        if on_policy_every and state["step"] % on_policy_every == 0:
            with torch.no_grad():
                prefix = ids[:, : ids.shape[1] - sample_len]
                ids = draft.generate(prefix, do_sample=True, max_new_tokens=sample_len, min_new_tokens=sample_len)
        with torch.no_grad():
            p_logits = target(input_ids=ids).logits
        q_logits = draft(input_ids=ids).logits
        return token_divergence(p_logits.float(), q_logits.float(), divergence)

    return loss_fn


def timed(device, fn):
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def decode_benchmarks(target, draft, prompts, args, device):
    results = []
    gen = torch.Generator(device=device).manual_seed(0)

    def hf(prompt, temperature, assistant):
        kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=temperature > 0)
        if temperature > 0:
            kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
        if assistant is not None:
            kwargs["assistant_model"] = assistant
        return target.generate(prompt, **kwargs)

    engine = DecodeEngine(target, max_len=args.prompt_len + args.new_tokens) if args.engine else None
    methods = []
    for temperature in (0.0, 1.0):
        methods.append(("autoregressive", temperature, None, None))
        if engine is not None:  # static cache, on-device sampling, one CUDA graph per token on a GPU
            methods.append(("engine_autoregressive", temperature, None, None))
        methods.append(("hf_assisted", temperature, None, None))
        methods.append(("neutrain_sd", temperature, 1, "sd"))
        for k in (2, 4):
            schemes = ["greedy_tree"] if temperature == 0 else ["specinfer", "spectr", "importance"]
            for scheme in schemes:
                methods.append((f"neutrain_{scheme}", temperature, k, scheme))
    greedy_reference = {}
    for name, temperature, k, scheme in methods:
        new_tokens = wall = 0.0
        stats = {"target_calls": 0, "committed_tokens": 0, "verified_positions": 0, "accepted_positions": 0}
        matches = []
        for i, prompt in enumerate([prompts[0]] + prompts):  # first pass = warm-up, not counted
            prompt = prompt.to(device)
            if name in ("autoregressive", "hf_assisted"):
                out, sec = timed(device, lambda: hf(prompt, temperature, draft if name == "hf_assisted" else None))
                seq = out[0]
            elif name == "engine_autoregressive":
                out, sec = timed(device, lambda: engine.generate(prompt, args.new_tokens, temperature=temperature))
                seq = out[0]
            else:
                out, sec = timed(device, lambda: generate(
                    target, draft, prompt, num_drafts=k, draft_len=args.draft_len,
                    scheme="sd" if k == 1 else ("specinfer" if scheme == "greedy_tree" else scheme),
                    temperature=temperature, max_new_tokens=args.new_tokens, generator=gen, engine=args.engine))
                seq = out.sequences[0]
                if i > 0:
                    for key in stats:
                        stats[key] += getattr(out.stats, key)
            if i == 0:
                continue
            new_tokens += seq.numel() - prompt.shape[1]
            wall += sec
            if temperature == 0:
                if name == "autoregressive":
                    greedy_reference[i] = seq.tolist()
                else:
                    ref = greedy_reference[i]
                    same = sum(a == b for a, b in zip(seq.tolist(), ref))
                    matches.append(same == len(ref) == seq.numel())
        row = {"method": name, "temperature": temperature, "num_drafts": k, "tokens_per_s": new_tokens / wall,
               "new_tokens": new_tokens, "seconds": wall}
        if stats["target_calls"]:
            row["block_efficiency"] = stats["committed_tokens"] / stats["target_calls"]
            row["acceptance"] = stats["accepted_positions"] / max(stats["verified_positions"], 1)
        if matches:
            row["greedy_equals_autoregressive"] = f"{sum(matches)}/{len(matches)}"
        log(row)
        results.append(row)
    return results


def headline(results: dict) -> str:
    """The numbers that matter, for the README table (computed from ``results`` only)."""
    t1, t0, alpha = results["targets"]["T1"], results["targets"]["T0"], results["alpha"]
    be = t1["block_efficiency_k4_over_sd"]
    best_be = max(be, key=be.get)
    return (
        f"T=1: K=4 {best_be.removeprefix('neutrain_')} {be[best_be]:.2f}x SD tokens/call, "
        f"{t1['best_speedup_over_hf_assisted']:.2f}x HF assisted, {t1['best_speedup_over_autoregressive']:.2f}x AR; "
        f"T=0: {t0['best_speedup_over_hf_assisted']:.2f}x HF assisted, {t0['best_speedup_over_autoregressive']:.2f}x AR; "
        f"alpha distilled {alpha['distilled_T1']:.3f} vs control {alpha['control_T1']:.3f}"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny CPU smoke run")
    parser.add_argument("--target-seconds", type=float, default=120)
    parser.add_argument("--draft-steps", type=int, default=500)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--draft-hidden", type=int, default=384)
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--divergence", default="fkl")
    parser.add_argument("--on-policy-every", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--draft-len", type=int, default=4)
    parser.add_argument("--max-files", type=int, default=None)
    parser.add_argument("--name", default="speculative")
    parser.add_argument("--engine", action="store_true",
                        help="add the DecodeEngine's autoregressive decode and run the speculative schemes on its static caches")
    args = parser.parse_args()
    git_provenance()  # fail now, not after the measurement, if the commit cannot be recorded
    if args.quick:
        args.target_seconds, args.draft_steps, args.hidden, args.layers = 20, 20, 64, 2
        args.draft_hidden, args.vocab, args.seq, args.batch = 32, 512, 64, 8
        args.prompts, args.new_tokens, args.max_files, args.name = 2, 16, 40, "speculative_quick"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # decode in fp32 so tree and sequential logits agree
    t0 = time.time()
    tok, train_ids, held_ids, held_docs = build_corpus(os.environ.get("NEUTRAIN_CACHE", "/tmp/neutrain-cache"), args.vocab, args.max_files)
    log(f"corpus: {train_ids.numel()} train tokens, {held_ids.numel()} held-out tokens ({time.time() - t0:.0f}s)")
    vocab = len(tok)
    gen = torch.Generator().manual_seed(0)

    target = make_llama(vocab, args.hidden, args.layers, max(args.hidden // 64, 2), 4 if args.hidden >= 256 else 2,
                        int(args.hidden * 8 / 3) // 64 * 64, device, seed=0)
    target_params = sum(p.numel() for p in target.parameters())
    steps_t, tokens_t, loss_t = train(target, batches(train_ids, args.batch, args.seq, gen), seconds=args.target_seconds,
                                      lr=1e-3, device=device, label="target")
    log(f"target {target_params / 1e6:.1f}M params: {steps_t} steps, {tokens_t} tokens, loss {loss_t:.3f}")
    for p in target.parameters():
        p.requires_grad_(False)

    def new_draft():
        return make_llama(vocab, args.draft_hidden, args.draft_layers, max(args.draft_hidden // 64, 2), 2,
                          int(args.draft_hidden * 8 / 3) // 64 * 64, device, seed=1)

    control, distilled = new_draft(), new_draft()
    draft_params = sum(p.numel() for p in control.parameters())
    gen_c, gen_d = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)  # same batches for both
    _, tokens_c, loss_c = train(control, batches(train_ids, args.batch, args.seq, gen_c), steps=args.draft_steps,
                                lr=2e-3, device=device, label="control")
    loss_fn = distill_loss_fn(target, args.divergence, args.on_policy_every, args.seq // 2)
    _, tokens_d, loss_d = train(distilled, batches(train_ids, args.batch, args.seq, gen_d), steps=args.draft_steps,
                                lr=2e-3, device=device, loss_fn=loss_fn, label="distill")
    for model in (target, control, distilled):
        model.float()

    held_iter = batches(held_ids, 8, args.seq, torch.Generator().manual_seed(2))
    held_batches = [next(held_iter) for _ in range(4)]
    held_loss = {}
    with torch.no_grad():  # held-out cross-entropy: shows how far the target generalises beyond its training text
        for name, model in (("target", target), ("control", control), ("distilled", distilled)):
            held_loss[name] = sum(float(model(input_ids=b.to(device), labels=b.to(device)).loss) for b in held_batches) / 4
    log("held-out loss", held_loss)
    alpha = {}
    for name, model in (("control", control), ("distilled", distilled)):
        for temperature in (1.0, 0.0):
            alpha[f"{name}_T{temperature:g}"] = acceptance_rate(
                target, model, [{"input_ids": b.to(device)} for b in held_batches], temperature)
    log("alpha", alpha)

    prompts = [torch.tensor([d[: args.prompt_len]]) for d in held_docs if len(d) >= args.prompt_len][: args.prompts]
    decode = decode_benchmarks(target, distilled, prompts, args, device)

    def find(method, temperature, k=None):
        for row in decode:
            if row["method"] == method and row["temperature"] == temperature and (k is None or row["num_drafts"] == k):
                return row
        return None

    targets = {}
    for temperature in (0.0, 1.0):
        sd = find("neutrain_sd", temperature)
        hf = find("hf_assisted", temperature)
        ar = find("autoregressive", temperature)
        k4 = [r for r in decode if r["temperature"] == temperature and r["num_drafts"] == 4]
        best = max(k4 + [sd], key=lambda r: r["tokens_per_s"])
        targets[f"T{temperature:g}"] = {
            "block_efficiency_k4_over_sd": {r["method"]: r["block_efficiency"] / sd["block_efficiency"] for r in k4},
            "best_neutrain_method": best["method"] + f"_K{best['num_drafts']}",
            "best_speedup_over_hf_assisted": best["tokens_per_s"] / hf["tokens_per_s"],
            "best_speedup_over_autoregressive": best["tokens_per_s"] / ar["tokens_per_s"],
        }
        engine_ar = find("engine_autoregressive", temperature)
        if engine_ar is not None:
            targets[f"T{temperature:g}"]["engine_ar_over_hf_ar"] = engine_ar["tokens_per_s"] / ar["tokens_per_s"]
            targets[f"T{temperature:g}"]["best_speedup_over_engine_ar"] = best["tokens_per_s"] / engine_ar["tokens_per_s"]
    targets["alpha_gain_points_T1"] = 100 * (alpha["distilled_T1"] - alpha["control_T1"])
    targets["alpha_gain_points_T0"] = 100 * (alpha["distilled_T0"] - alpha["control_T0"])
    settings = {**vars(args), "on_policy_tokens": args.seq // 2, "target_params": target_params, "draft_params": draft_params,
                "target_train_steps": steps_t, "target_train_tokens": tokens_t, "target_final_loss": loss_t,
                "draft_train_tokens": {"control": tokens_c, "distilled": tokens_d},
                "draft_final_loss": {"control_ce": loss_c, f"distilled_{args.divergence}": loss_d},
                "decode_dtype": "float32 (TF32 off)", "train_dtype": "bf16 autocast, fp32 master weights",
                "total_seconds": time.time() - t0}
    results = {"alpha": alpha, "held_out_loss": held_loss, "decode": decode, "targets": targets}
    results["headline"] = headline(results)
    path = write_result(args.name, settings, results)
    log("wrote", path)
    log(json.dumps(targets, indent=1))


if __name__ == "__main__":
    main()
