"""Training half of ``benchmarks/decode/speculative.py``: the corpus, the target, and two drafts of equal tokens.

* **Corpus.** neutrain.data's ``python-stdlib`` corpus (its held-out files stay held out) plus, so that a
  ~300M target trained for minutes sees each token about once instead of memorising two million
  tokens, the ``.py`` sources of the running Python's site-packages (``--extra-mb``; files whose text
  equals a held-out file are dropped). The BPE is trained on the stdlib training split.
* **Trainer.** AdamW (fused on CUDA), warm-up then cosine decay over a step horizon, bf16 autocast with
  fp32 master weights; :meth:`Trainer.clone` copies weights, optimizer moments, step and data position,
  so a second run can continue from the first's state.
* **Drafts.** The control trains ``N`` steps with cross-entropy. The distilled draft is the control's
  state after ``ce_fraction * N`` CE steps, then ``(1 - ce_fraction) * N`` steps on the target's
  distributions over the same batches (the same number of tokens: ``batch * seq`` a step for both), a
  share of them on-policy: the tail of the sequence is sampled from the draft itself (DistillSpec).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import site
import sysconfig
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from neutrain.data import python_stdlib_corpus, train_bpe_tokenizer
from neutrain.distill.losses import acceptance_rate, token_divergence

SKIP_DIRS = {"test", "tests", "testing", "__pycache__", "_vendor", "vendor"}


def log(*args):
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


def extra_sources(limit_bytes: int, exclude: set[str]) -> tuple[list[str], dict]:
    """Up to ``limit_bytes`` of site-packages ``.py`` text, in a fixed hash order; drops texts in ``exclude`` (md5s)."""
    if limit_bytes <= 0:
        return [], {"bytes": 0, "files": 0}
    roots = sorted({Path(p) for p in [*site.getsitepackages(), sysconfig.get_paths()["purelib"]] if Path(p).is_dir()})
    files = []
    for root in roots:
        for f in root.rglob("*.py"):
            rel = f.relative_to(root)
            if set(rel.parts[:-1]) & SKIP_DIRS:
                continue
            try:
                size = f.stat().st_size
            except OSError:
                continue
            if 2_000 <= size <= 200_000:
                files.append((hashlib.md5(str(rel).encode()).hexdigest(), f))
    texts, total, seen = [], 0, set(exclude)
    for _, f in sorted(files):
        text = f.read_text(encoding="utf-8", errors="replace")
        digest = hashlib.md5(text.encode()).hexdigest()
        if digest in seen:  # duplicates (vendored copies) and the held-out files themselves
            continue
        seen.add(digest)
        texts.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return texts, {"bytes": total, "files": len(texts), "roots": [str(r) for r in roots]}


def build_corpus(cache_dir: str, vocab_size: int, max_files: int | None, extra_mb: float):
    """``(tokenizer, train ids, held-out ids, held-out docs, info)``; ids are flat streams with EOS between files."""
    rows = [json.loads(line) for line in open(python_stdlib_corpus(cache_dir, max_files=max_files), encoding="utf-8")]
    train_texts = [r["text"] for r in rows if not r["heldout"]]
    held_texts = [r["text"] for r in rows if r["heldout"]]
    tok = train_bpe_tokenizer(train_texts, vocab_size=vocab_size)
    exclude = {hashlib.md5(t.encode()).hexdigest() for t in held_texts}
    extra, extra_info = extra_sources(int(extra_mb * 2**20), exclude)
    eos = tok.eos_token_id

    def stream(texts):
        ids = []
        for enc in tok(texts)["input_ids"]:
            ids.extend(enc + [eos])
        return torch.tensor(ids, dtype=torch.long)

    stdlib_ids, extra_ids, held_ids = stream(train_texts), stream(extra), stream(held_texts)
    info = {"stdlib_train_tokens": stdlib_ids.numel(), "stdlib_heldout_tokens": held_ids.numel(),
            "stdlib_train_files": len(train_texts), "stdlib_heldout_files": len(held_texts),
            "site_packages_tokens": extra_ids.numel(), "site_packages": extra_info}
    return tok, torch.cat([stdlib_ids, extra_ids]), held_ids, [tok(t)["input_ids"] for t in held_texts], info


def make_llama(vocab, hidden, layers, heads, kv_heads, inter, device, seed, attn_dropout=0.0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=0, attention_dropout=attn_dropout,
    )
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


class Batches:
    """Random windows ``[batch, seq]`` of a token stream; the generator state makes the order reproducible."""

    def __init__(self, stream: torch.Tensor, batch: int, seq: int, seed: int):
        self.stream, self.batch, self.seq = stream, batch, seq
        self.gen = torch.Generator().manual_seed(seed)

    def __next__(self) -> torch.Tensor:
        starts = torch.randint(0, self.stream.numel() - self.seq - 1, (self.batch,), generator=self.gen)
        return torch.stack([self.stream[s : s + self.seq] for s in starts])

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self


def autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)


LossFn = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]


def ce_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


class Trainer:
    """AdamW with linear warm-up and cosine decay to 10% over ``horizon`` steps (or seconds, see :meth:`run`)."""

    def __init__(self, model, data: Batches, device, lr: float, horizon: int, weight_decay: float = 0.1,
                 warmup: int = 50, label: str = ""):
        self.model, self.data, self.device, self.lr, self.horizon = model, data, device, lr, horizon
        self.warmup, self.label, self.weight_decay = warmup, label, weight_decay
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95),
                                     fused=device.type == "cuda")
        self.step, self.tokens, self.seconds, self.last_loss = 0, 0, 0.0, float("nan")

    def _lr(self, frac: float) -> float:
        return self.lr * min(1.0, (self.step + 1) / self.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))

    def run(self, steps: int | None = None, seconds: float | None = None, loss_fn: LossFn = ce_loss) -> "Trainer":
        """Train ``steps`` more steps, or until ``seconds`` pass (then the schedule follows elapsed time)."""
        self.model.train()
        start, done = time.time(), 0
        while (steps is None or done < steps) and (seconds is None or time.time() - start < seconds):
            ids = next(self.data).to(self.device)
            frac = (time.time() - start) / seconds if seconds else self.step / self.horizon
            for group in self.opt.param_groups:
                group["lr"] = self._lr(frac)
            with autocast(self.device):
                loss = loss_fn(self.model, ids)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.step, done, self.tokens = self.step + 1, done + 1, self.tokens + ids.numel()
            if self.step % 100 == 0:
                log(f"{self.label} step {self.step} loss {loss.item():.3f} ({time.time() - start:.0f}s)")
        self.last_loss = float(loss.item()) if done else self.last_loss
        self.seconds += time.time() - start
        self.model.eval()
        return self

    def clone(self, label: str) -> "Trainer":
        """An independent copy: weights, optimizer moments, step, token count and the data order's position."""
        data = Batches(self.data.stream, self.data.batch, self.data.seq, 0)  # the stream is shared, not copied
        data.gen.set_state(self.data.gen.get_state())
        twin = Trainer(copy.deepcopy(self.model), data, self.device, self.lr, self.horizon,
                       self.weight_decay, self.warmup, label)
        twin.opt.load_state_dict(copy.deepcopy(self.opt.state_dict()))
        twin.step, twin.tokens, twin.last_loss = self.step, self.tokens, self.last_loss
        return twin


class DraftSampler:
    """Samples continuations from the draft being trained (on-policy data), in its DecodeEngine when it works."""

    def __init__(self, batch: int, seq: int, seed: int):
        self.batch, self.seq, self.seed, self.engine, self.backend = batch, seq, seed, None, None

    @torch.no_grad()
    def __call__(self, draft, prefix: torch.Tensor, new: int) -> torch.Tensor:
        was_training = draft.training
        draft.eval()
        # The loss runs under bf16 autocast; the engine's static cache holds the draft's own (fp32) dtype.
        no_autocast = torch.autocast(prefix.device.type, enabled=False)
        try:
            no_autocast.__enter__()
            if self.backend != "hf_generate":
                try:
                    if self.engine is None or self.engine.model is not draft:  # the graph reads the weights in
                        # place, so the optimizer's updates show in later samples
                        from neutrain.decode.engine import DecodeEngine

                        self.engine = DecodeEngine(draft, max_len=self.seq, batch=self.batch, seed=self.seed)
                    out = self.engine.generate(prefix, new, temperature=1.0)
                    self.backend = "DecodeEngine"
                    return out[:, : prefix.shape[1] + new]
                except Exception as exc:  # fall back once, and say so in the settings
                    log(f"on-policy sampling falls back to HF generate: {type(exc).__name__}: {exc}"[:300])
                    self.backend, self.engine = "hf_generate", None
            return draft.generate(prefix, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                  max_new_tokens=new, min_new_tokens=new)
        finally:
            no_autocast.__exit__(None, None, None)
            draft.train(was_training)


def distill_loss(target, divergence: str, on_policy_every: int, sample_len: int, batch: int, seq: int,
                 seed: int = 0) -> LossFn:
    """The divergence between the target's and the draft's next-token distributions (T = 1).

    Every ``on_policy_every``-th call replaces the last ``sample_len`` tokens of the batch by the
    draft's own samples (the prefix stays corpus text), so the target scores what the draft writes.
    """
    state = {"calls": 0, "on_policy": 0}
    sampler = DraftSampler(batch, seq, seed)

    def loss_fn(draft, ids):
        state["calls"] += 1
        if on_policy_every and state["calls"] % on_policy_every == 0:
            ids = sampler(draft, ids[:, : ids.shape[1] - sample_len], sample_len)
            state["on_policy"] += 1
        with torch.no_grad():
            p_logits = target(input_ids=ids).logits
        q_logits = draft(input_ids=ids).logits
        return token_divergence(p_logits.float(), q_logits.float(), divergence)

    loss_fn.state, loss_fn.sampler = state, sampler  # type: ignore[attr-defined]
    return loss_fn


@torch.no_grad()
def mean_loss(model, batches: list[torch.Tensor], device) -> float:
    """Mean next-token cross-entropy over ``batches`` (eval mode, bf16 autocast on CUDA)."""
    model.eval()
    with autocast(device):
        return sum(float(model(input_ids=b.to(device), labels=b.to(device)).loss) for b in batches) / len(batches)


def alpha_of(target, draft, batches: list[torch.Tensor], device, temperature: float) -> float:
    with autocast(device):
        return acceptance_rate(target, draft, [{"input_ids": b.to(device)} for b in batches], temperature)


def choose_divergence(base: Trainer, target, candidates: list[str], steps: int, probe: list[torch.Tensor],
                      loss_args: dict) -> tuple[str, dict]:
    """Train a copy of ``base`` for ``steps`` with each divergence; the one with the highest alpha (T = 1) wins.

    ``probe`` is text from the training stream (the held-out set stays untouched for the report).
    """
    scores = {}
    for kind in candidates:
        trial = base.clone(f"probe-{kind}")
        trial.run(steps=steps, loss_fn=distill_loss(target, kind, **loss_args))
        scores[kind] = alpha_of(target, trial.model, probe, base.device, 1.0)
        log(f"probe {kind}: alpha T=1 {scores[kind]:.4f}")
        del trial
    return max(scores, key=scores.get), scores
