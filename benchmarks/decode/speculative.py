"""Benchmark: distilled drafts and exact multi-draft speculative decoding on neutrain's decode engine.

One process, one GPU, a time budget (``--budget-s``); everything is trained inside the run, because GPU
hosts start bare:

1. The Llama-3-8B architecture's autoregressive decode at batch 1 in the DecodeEngine (dense bf16, NeuZip
   lossless, NeuZip lossy-3) against the HBM roofline: ``benchmarks/decode/engine_decode.py`` in a subprocess,
   first, so a failure there cannot take the rest down.
2. The corpus (``benchmarks/decode/_spec_train.py``): neutrain.data's python-stdlib corpus (held-out files kept
   out) plus site-packages sources, so the ~300M target sees each token about once.
3. The target (~300M parameters) trains for ``--target-seconds``; its train and held-out loss are reported.
4. Two drafts (~15x smaller) with equal tokens: a CE control, and a distilled draft that starts from the
   control's state after ``--ce-fraction`` of the steps and then trains on the target's distributions
   (on-policy every ``--on-policy-every`` steps), with the divergence chosen on a short probe.
5. alpha at T = 0 and 1 of both drafts on held-out text.
6. Decode of held-out prompts at T = 0 and 1 in bf16 (``benchmarks/decode/_spec_decode.py``): the engine's AR,
   neutrain's schemes with ``engine=True`` (K = 1, 2, 4), HF assisted generation with the distilled draft,
   and HF ``generate`` with a static cache and ``torch.compile``; plus the per-round time split of the best scheme.

Run: ``bash benchmarks/decode/gpu_speculative.sh`` on the device (it sets the commit variables' checks and the
budget); ``python benchmarks/decode/speculative.py --quick --out-dir /tmp/x`` is a CPU smoke test (< 2 min).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import git_provenance, write_result  # noqa: E402
from benchmarks.decode._spec_decode import GOALS, RETIRED_TARGETS, Clock, decode_benchmarks, log, round_split  # noqa: E402
from benchmarks.decode._spec_train import (  # noqa: E402
    Batches, Trainer, alpha_of, build_corpus, choose_divergence, distill_loss, make_llama, mean_loss,
)

HERE = Path(__file__).resolve().parent


def run_8b(args, clock: Clock) -> dict:
    """benchmarks/decode/engine_decode.py in a subprocess (its own CUDA context, freed on exit); its record, or the error."""
    out_dir = tempfile.mkdtemp(prefix="engine_decode_")
    cmd = [sys.executable, str(HERE / "engine_decode.py"), "--out-dir", out_dir, "--skip-hf", "--no-gemv",
           "--prompt-len", str(args.big_prompt_len), "--new-tokens", str(args.big_new_tokens),
           "--repeats", str(args.big_repeats), "--budget-s", str(args.big_budget_s * 0.6)]
    cmd += ["--tiny", "--weights", "dense,neuzip-lossless"] if args.quick else []
    cmd += ["--layers", str(args.big_layers)] if args.big_layers else []
    log("8B:", " ".join(cmd))
    path = Path(out_dir) / ("engine_decode_tiny.json" if args.quick else "engine_decode.json")
    error = None
    try:
        proc = subprocess.run(cmd, timeout=args.big_budget_s, capture_output=True, text=True)
        print(proc.stdout[-3000:], proc.stderr[-2000:] if proc.returncode else "", flush=True)
        if proc.returncode:
            error = f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:] if proc.stderr else ''}"
    except subprocess.TimeoutExpired:
        error = f"timed out after {args.big_budget_s:.0f} s"
    log(f"8B phase done at {clock.elapsed():.0f}s" + (f": {error}" if error else ""))
    record = json.loads(path.read_text()) if path.exists() else {}  # written after every variant
    return {**record, "error": error} if error else record


def train_models(args, device, clock: Clock):
    tok, train_ids, held_ids, held_docs, corpus = build_corpus(
        os.environ.get("NEUTRAIN_CACHE", "/tmp/neutrain-cache"), args.vocab, args.max_files, args.extra_mb)
    log(f"corpus {corpus} ({clock.elapsed():.0f}s)")
    vocab = len(tok)
    inter = args.inter or int(args.hidden * 8 / 3) // 64 * 64
    target = make_llama(vocab, args.hidden, args.layers, args.heads, args.kv_heads, inter, device, 0, args.attn_dropout)
    target_params = sum(p.numel() for p in target.parameters())
    t = Trainer(target, Batches(train_ids, args.batch, args.seq, 0), device, args.lr, horizon=10**9,
                weight_decay=args.weight_decay, label="target").run(seconds=args.target_seconds)
    target.requires_grad_(False)
    log(f"target {target_params / 1e6:.1f}M params: {t.step} steps, {t.tokens} tokens ({clock.elapsed():.0f}s)")

    d_inter = int(args.draft_hidden * 8 / 3) // 64 * 64
    d_heads = max(args.draft_hidden // 64, 2)
    draft = make_llama(vocab, args.draft_hidden, args.draft_layers, d_heads, 4 if d_heads % 4 == 0 else d_heads,
                       d_inter, device, 1)
    draft_params = sum(p.numel() for p in draft.parameters())
    control = Trainer(draft, Batches(train_ids, args.batch, args.seq, 1), device, args.draft_lr, horizon=args.draft_steps,
                      weight_decay=0.1, label="control")
    shared = round(args.ce_fraction * args.draft_steps)
    control.run(steps=shared)
    probe_iter = Batches(train_ids, 8, args.seq, 3)
    probe = [next(probe_iter) for _ in range(2)]
    loss_args = dict(on_policy_every=args.on_policy_every, sample_len=args.seq // 4, batch=args.batch, seq=args.seq)
    divergence, probe_alpha = (args.divergence, {})
    if args.divergence == "probe":
        divergence, probe_alpha = choose_divergence(control, target, ["fkl", "tvd", "jsd"], args.probe_steps, probe, loss_args)
    distilled = control.clone("distill")
    control.run(steps=args.draft_steps - shared)
    loss_fn = distill_loss(target, divergence, **loss_args)
    distilled.run(steps=args.draft_steps - shared, loss_fn=loss_fn)
    log(f"drafts {draft_params / 1e6:.1f}M params: control {control.tokens} tokens, distilled {distilled.tokens} "
        f"({divergence}, {loss_fn.state['on_policy']} on-policy batches via {loss_fn.sampler.backend}) ({clock.elapsed():.0f}s)")

    held_iter, train_iter = Batches(held_ids, 8, args.seq, 2), Batches(train_ids, 8, args.seq, 4)
    stdlib_iter = Batches(train_ids[: corpus["stdlib_train_tokens"]], 8, args.seq, 5)
    held, seen, stdlib = ([next(it) for _ in range(4)] for it in (held_iter, train_iter, stdlib_iter))
    # target_stdlib_train vs target_heldout: the same distribution (stdlib files), seen vs held out.
    losses = {"target_train": mean_loss(target, seen, device), "target_stdlib_train": mean_loss(target, stdlib, device),
              "target_heldout": mean_loss(target, held, device),
              "control_heldout": mean_loss(control.model, held, device),
              "distilled_heldout": mean_loss(distilled.model, held, device)}
    alpha = {f"{name}_T{temp:g}": alpha_of(target, m.model, held, device, temp)
             for name, m in (("control", control), ("distilled", distilled)) for temp in (1.0, 0.0)}
    log("loss", losses, "alpha", alpha)
    settings = {"corpus": corpus, "vocab_size": vocab, "target_params": target_params, "draft_params": draft_params,
                "target_intermediate": inter, "draft_intermediate": d_inter, "target_train_steps": t.step,
                "target_train_tokens": t.tokens, "target_train_seconds": t.seconds,
                "target_epochs": t.tokens / train_ids.numel(), "target_last_batch_loss": t.last_loss,
                "draft_train_tokens": {"control": control.tokens, "distilled": distilled.tokens},
                "draft_token_accounting": f"both drafts: {args.draft_steps} steps of {args.batch}x{args.seq} tokens; "
                f"the first {shared} CE steps are shared (the distilled draft starts from the control's weights, "
                f"optimizer and data position there), then {args.draft_steps - shared} CE steps (control) or "
                f"{divergence} steps on the same batches (distilled), every {args.on_policy_every}th with its last "
                f"{args.seq // 4} tokens sampled from the draft; probe runs (discarded) are not counted",
                "divergence": divergence, "divergence_probe_alpha_T1": probe_alpha,
                "divergence_probe": f"{args.probe_steps} steps from the shared CE state, alpha on 2x8x{args.seq} training-stream tokens",
                "on_policy_batches": loss_fn.state["on_policy"], "on_policy_sampler": loss_fn.sampler.backend,
                "draft_last_batch_loss": {"control_ce": control.last_loss, f"distilled_{divergence}": distilled.last_loss}}
    prompts = [torch.tensor([d[: args.prompt_len]]) for d in held_docs if len(d) >= args.prompt_len][: args.prompts]
    return target, control.model, distilled.model, prompts, {"loss": losses, "alpha": alpha}, settings


def targets_from(rows, alpha, big) -> tuple[dict, dict]:
    def find(method, temperature, k=None):
        return next((r for r in rows if r["method"] == method and r.get("temperature") == temperature
                     and (k is None or r.get("num_drafts") == k) and "tokens_per_s" in r), None)

    values, detail = {}, {}
    for temp in (0.0, 1.0):
        spec = [r for r in rows if r["method"].startswith("neutrain_") and r.get("temperature") == temp and "tokens_per_s" in r]
        ar, hf = find("engine_autoregressive", temp), find("hf_assisted", temp)
        best = max(spec, key=lambda r: r["tokens_per_s"]) if spec else None
        detail[f"best_T{temp:g}"] = best and f"{best['method']}_K{best['num_drafts']}"
        values[f"spec_over_ar_T{temp:g}"] = best and ar and best["tokens_per_s"] / ar["tokens_per_s"]
        if temp == 1.0:
            values["spec_over_hf_assisted_T1"] = best and hf and best["tokens_per_s"] / hf["tokens_per_s"]
            sd, k4 = find("neutrain_sd", temp), [r for r in spec if r.get("num_drafts") == 4]
            top = max(k4, key=lambda r: r["block_efficiency"]) if k4 else None
            values["k4_block_eff_over_sd_T1"] = sd and top and top["block_efficiency"] / sd["block_efficiency"]
            detail["k4_block_eff_scheme"] = top and top["method"]
    values["alpha_gain_points_T1"] = 100 * (alpha["distilled_T1"] - alpha["control_T1"])
    for name in ("ar_roofline_fraction_8b", "neuzip_lossless_over_bf16_decode"):
        values[name] = (big.get("targets") or {}).get(name, {}).get("value")
    targets = {name: {"value": values.get(name), "goal": goal} for name, goal in GOALS.items()}
    for name, extra in (("spec_over_ar_T0", "best_T0"), ("spec_over_ar_T1", "best_T1")):
        targets[name]["method"] = detail.get(extra)
    # Two ratios an earlier set of targets named: still measured, reported beside the targets.
    detail["ratios"] = {name: {"value": values.get(name), "former_goal": goal,
                               "method": detail.get("best_T1" if name == "spec_over_hf_assisted_T1" else "k4_block_eff_scheme")}
                        for name, goal in RETIRED_TARGETS.items()}
    for entry in targets.values():
        if entry["value"] is None:
            entry["note"] = "not measured in this run (see results: skipped or error rows)"
    return targets, detail


def headline(targets: dict, alpha: dict, detail: dict) -> str:
    def f(name, unit=""):
        v = (targets.get(name) or detail["ratios"].get(name, {})).get("value")
        return "n/a" if v is None else f"{v:.2f}{unit}"
    return (f"spec/AR T=0 {f('spec_over_ar_T0', 'x')} ({detail.get('best_T0')}), T=1 {f('spec_over_ar_T1', 'x')} "
            f"({detail.get('best_T1')}); vs HF assisted T=1 {f('spec_over_hf_assisted_T1', 'x')}; alpha T=1 distilled "
            f"{alpha['distilled_T1']:.3f} vs control {alpha['control_T1']:.3f}; K=4/SD block eff {f('k4_block_eff_over_sd_T1')}; "
            f"8B AR {f('ar_roofline_fraction_8b')} of roofline; NeuZip lossless/bf16 {f('neuzip_lossless_over_bf16_decode')}")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--quick", action="store_true", help="tiny CPU smoke run (< 2 min)")
    a("--budget-s", type=float, default=540, help="this process's time budget; late rows are skipped and say so")
    a("--reserve-s", type=float, default=25, help="seconds kept for the split, the JSON and exit")
    a("--compile-reserve-s", type=float, default=60, help="seconds HF torch.compile needs to be tried")
    a("--no-hf-static", dest="hf_static", action="store_false")
    a("--skip-8b", action="store_true")
    a("--big-budget-s", type=float, default=130, help="the 8B subprocess's timeout; it starts no new weights variant after 60%% of it")
    a("--big-layers", type=int, default=None, help="fewer 8B layers (recorded) if the call is short")
    a("--big-prompt-len", type=int, default=128)
    a("--big-new-tokens", type=int, default=128)
    a("--big-repeats", type=int, default=2)
    a("--target-seconds", type=float, default=140)
    a("--hidden", type=int, default=1024)
    a("--layers", type=int, default=26)
    a("--heads", type=int, default=16)
    a("--kv-heads", type=int, default=4)
    a("--inter", type=int, default=2816)
    a("--lr", type=float, default=8e-4)
    a("--weight-decay", type=float, default=0.1)
    a("--attn-dropout", type=float, default=0.0)
    a("--draft-hidden", type=int, default=768)
    a("--draft-layers", type=int, default=2)
    a("--draft-steps", type=int, default=800)
    a("--draft-lr", type=float, default=2e-3)
    a("--ce-fraction", type=float, default=0.4)
    a("--divergence", default="probe", help="fkl, rkl, tvd, jsd, or probe (choose among fkl/tvd/jsd by measurement)")
    a("--probe-steps", type=int, default=40)
    a("--on-policy-every", type=int, default=2)
    a("--vocab", type=int, default=8192)
    a("--seq", type=int, default=512)
    a("--batch", type=int, default=32)
    a("--extra-mb", type=float, default=48)
    a("--max-files", type=int, default=None)
    a("--prompts", type=int, default=4)
    a("--prompt-len", type=int, default=128)
    a("--new-tokens", type=int, default=128)
    a("--draft-len", type=int, default=4)
    a("--name", default="speculative")
    a("--out-dir", default=None, help="where the JSON goes (default: a row of benchmarks/decode/results.jsonl)")
    args = p.parse_args(argv)
    if args.quick:
        quick = dict(
            budget_s=150, target_seconds=8, hidden=64, layers=2, heads=2, kv_heads=2, inter=128, draft_hidden=64,
            draft_layers=1, draft_steps=12, probe_steps=2, vocab=512, seq=64, batch=4, extra_mb=0.2, max_files=40,
            prompts=2, prompt_len=16, new_tokens=12, big_new_tokens=4, big_prompt_len=4, big_repeats=1,
            big_budget_s=60, name="speculative_quick", hf_static=False, reserve_s=5)
        # A flag given on the command line wins over the --quick preset: the CI test lifts the time budgets
        # so that a loaded machine skips no row (a test must not depend on the machine's speed).
        args.__dict__.update({k: v for k, v in quick.items() if getattr(args, k) == p.get_default(k)})
    return args


def main(argv=None):
    args = parse(argv)
    git_provenance()  # fail now, not after the measurement, if the commit cannot be recorded
    clock = Clock(args.budget_s)
    big = {"skipped": "--skip-8b"} if args.skip_8b else run_8b(args, clock)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target, control, distilled, prompts, quality, train_settings = train_models(args, device, clock)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for model in (target, control, distilled):
        model.to(dtype)
    rows = decode_benchmarks(target, distilled, prompts, args, device, clock)
    targets, detail = targets_from(rows, quality["alpha"], big)
    split = None
    best = next((r for r in rows if detail.get("best_T1") and "ms_per_round" in r and r["temperature"] == 1.0
                 and f"{r['method']}_K{r['num_drafts']}" == detail["best_T1"]), None)
    if best is not None:
        try:
            split = round_split(best, rows, distilled, prompts[0], args, device)
        except Exception as exc:
            split = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    settings = {**vars(args), **train_settings, "decode_dtype": str(dtype), "train_dtype": "bf16 autocast, fp32 master weights",
                "timing": "tokens/s = median over prompts of new tokens / synchronized wall time of the whole generate",
                "total_seconds": clock.elapsed()}
    results = {**quality, "decode": rows, "round_split_best_T1": split, "engine_8b": big, "ratios": detail["ratios"],
               "headline": headline(targets, quality["alpha"], detail)}
    path = write_result(args.name, settings, results, args.out_dir, targets=targets)
    log("wrote", path)
    for name, entry in targets.items():
        print(f"{name:>36} {entry['value'] if entry['value'] is None else round(entry['value'], 3)!s:>8} (goal {entry['goal']})")
    return path


if __name__ == "__main__":
    main()
