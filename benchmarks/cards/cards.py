"""The run fits the card: the literal user commands, end to end, under the budgets of real cards.

For each device budget (GiB: 22, 14.5, 11 and 7, the room on 24, 16, 12 and 8 GB cards) it runs, as a user
types them:

1. ``accelerate launch recipes/llama3_8b.yaml memory.device_budget_gib=B train.max_steps=22
   train.save_steps=20 memory.stochastic_rounding=false train.deterministic=true ...``: the uninterrupted
   run (checkpoints 20 and 22; deterministic kernels, else attention's backward makes two runs differ:
   training/NOTES.md);
   its checkpoint-22 is set aside as the reference;
2. the same command with ``train.resume_from_checkpoint=<run>/checkpoint-20 export.format=hf``: resumes for
   2 steps, saves checkpoint-22 again and exports; the two checkpoint-22 must hold the same tensors, byte for
   byte (their manifests' per-tensor sha256);
3. ``neutrain generate <export> --device-budget-gib B``, then the same export with no budget (dense on the
   card): the two greedy continuations must be the same text.

Every command must exit 0. Budget 5 (a 6 GB card) is the ``card_6gb_whole_run_ok`` target's journey.
From each run's ``summary.json`` and ``metrics.jsonl`` it records the configuration the run chose, each phase's measured peak (allocated, reserved, device) beside the planner's
prediction, and tok/s; then timing runs (:data:`TIMING`): the shipped recipe (``memory.weights: auto``) with no
budget and at 11, 7 and 5 GiB, at batch 1 and 8 (5 GiB at batch 8 chunks the MLP), and dense weights with no
budget at batch 1. Each timing row
records the weights and configuration its fit chose and the step time the fit predicted for it
(:mod:`neutrain.memory.step_time`), beside the measured tok/s. ``--part`` runs a subset (one process per GPU);
``--merge`` writes ``cards.json`` with the targets from the parts; each part's record holds the targets its own
runs give. The timing run ``gen_9`` (:mod:`benchmarks.cards._generate_timing`, not in the default list) times
``neutrain generate`` of the recipe's model under 9 GiB against the same export dense and unbounded, for
``generate_9gib_over_dense_tokens_per_s``.

    python benchmarks/cards/cards.py --part gen --budgets "" --timing gen_9
    python benchmarks/cards/cards.py --part gpu0 --budgets 7,14.5 --timing b8_none,b8_7
    python benchmarks/cards/cards.py --merge $OUT/cards_gpu0.json $OUT/cards_gpu1.json
    python benchmarks/cards/cards.py --smoke --part smoke --budgets "" --timing b1_none,b1_dense   # the flow on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.training._checkpoints import checkpoint_tensors, decoded_differences  # noqa: E402 (after the path is set)
from benchmarks._common import read_run  # noqa: E402
from benchmarks.cards._generate_timing import GENERATE, TARGET as GENERATE_TARGET, generate_run, generate_target  # noqa: E402

GIB = 2**30
RECIPE = "recipes/llama3_8b.yaml"
PCIE4_BYTES_PER_S = 25e9  # a consumer card's PCIe 4.0 x16 link, each direction
PHASES = ("build", "train_step", "eval", "generate", "save", "resume", "export")
TIMING = {  # name: (budget or "none", micro batch, overrides): each alone on its GPU, for the targets' ratios
    "b1_none": ("none", 1, ()), "b1_11": (11, 1, ()), "b1_7": (7, 1, ()), "b1_5": (5, 1, ()),
    "b8_none": ("none", 8, ()), "b8_11": (11, 8, ()), "b8_7": (7, 8, ()),
    # A 6 GB card at batch 8 x 1024: the fit chunks the MLP (memory.mlp_chunk_tokens) to fit 5 GiB.
    "b8_5": (5, 8, ()),
    "b1_dense": ("none", 1, ("memory.weights=dense",)),  # the speed `weights: auto` must reach with no budget
}
TIMING_STEPS = 10
TARGETS = ("card_8gb_over_unbounded_tokens_per_s_batch8", "card_6gb_over_unbounded_tokens_per_s_batch8",
           "card_12gb_over_unbounded_tokens_per_s",
           "max_phase_peak_over_train_step_peak", "planner_phase_max_relative_error", "card_6gb_whole_run_ok",
           "auto_unbounded_over_dense_tokens_per_s_batch1", "card_12gb_over_dense_unbounded_tokens_per_s_batch1",
           "fit_step_time_max_relative_error", GENERATE_TARGET)
GATE_BUDGETS = {22.0, 14.5, 11.0, 7.0}  # 24, 16, 12 and 8 GB cards; 5.0 (a 6 GB card) is a target


def sh(cmd: list[str], log: Path, timeout: float, stdout: Path | None = None) -> tuple[int, float, str]:
    """Run ``cmd``; its output to ``log`` (its stdout alone to ``stdout`` when given); (exit code, seconds, last lines)."""
    t0 = time.perf_counter()
    with open(log, "w") as fh, open(stdout or os.devnull, "w") as out:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        try:
            rc = subprocess.run(cmd, stdout=out if stdout else fh, stderr=subprocess.STDOUT if stdout is None else fh,
                                timeout=timeout, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    tail = log.read_text(errors="replace").splitlines()[-12:]
    return rc, round(time.perf_counter() - t0, 1), "\n".join(tail)


def phase_seconds(run: dict) -> dict[str, float]:
    """{phase: wall seconds} of one launch (from its phase records): where a journey's time goes."""
    return {r["phase"]: r["seconds"] for r in run["phases"] if "seconds" in r}


SMOKE: list[str] = []  # --smoke: CPU settings appended to every launch (a flow check, no measurement)


def launch(overrides: list[str]) -> list[str]:
    return ["accelerate", "launch", *(["--cpu"] if SMOKE else []), RECIPE, *overrides, *SMOKE]


def tokens_per_s(steps: list[dict], first: int = 3, last: int | None = None) -> float | None:
    """Median tok/s over logged steps ``first``..``last`` (the first steps warm up; a save's interval is out)."""
    vals = [s["tokens_per_second"] for s in steps if "tokens_per_second" in s
            and s.get("step", 0) >= first and (last is None or s.get("step", 0) <= last)]
    return round(statistics.median(vals), 1) if vals else None


def phase_table(*runs: dict) -> dict:
    """{phase: {"measured": {...}, "predicted": {...}}} from the runs' phase records (the largest of each)."""
    table: dict = {}
    for run in runs:
        records = list(run["phases"])
        for name, rec in (run["summary"].get("phase_memory") or {}).items():
            records.append({"phase": name, **rec} if isinstance(rec, dict) else {"phase": name})
        for rec in records:
            entry = table.setdefault(rec["phase"], {"measured": {}, "predicted": {}})
            for key, value in rec.items():
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    continue
                if key.startswith("predicted_"):  # predicted_{allocated,reserved,device}_gib
                    side, name = "predicted", key.removeprefix("predicted_")
                elif key in ("peak_allocated_gib", "peak_reserved_gib", "device_used_gib"):
                    side, name = "measured", key.removeprefix("peak_").replace("_used", "")
                else:
                    continue
                entry[side][name] = max(value, entry[side].get(name, value))
    return table


def budget_run(budget: float, work: Path, out: Path, limit: float, rec: dict, flush) -> dict:
    """The whole user journey at one budget: train 22 with a save at 20, resume 20->22 and export, generate (the
    smoke: train 4 with a save at 2, resume 2->4).

    ``rec`` is filled in place and ``flush()`` writes it after each command: a call cut off by its time
    limit keeps what ran (the first call at 4c4718b lost four journeys' records to the timeout of the last
    command, generate).
    """
    tag = f"{budget:g}"
    run, export = work / f"run_{tag}", work / f"export_{tag}"
    # The smoke checks the flow, not the rate: 4 steps with a save at 2 resume the same way (2 steps from a save).
    last, save = (4, 2) if SMOKE else (22, 20)
    common = [f"memory.device_budget_gib={budget}", "memory.stochastic_rounding=false", "train.deterministic=true",
              f"train.max_steps={last}", f"train.save_steps={save}", "train.save_total_limit=3", f"train.output_dir={run}"]
    rec.update({"budget_gib": budget, "commands": {}, "ok": False})
    rc, secs, tail = sh(launch(common), out / f"cards_{tag}_train.log", limit)
    rec["commands"]["train"] = {"rc": rc, "s": secs, **({"tail": tail} if rc else {})}
    first = read_run(run)
    rec["phases"] = phase_table(first)
    flush()
    rec["tokens_per_s"] = tokens_per_s(first["steps"], 3, save - 1)
    rec["choice"] = first["summary"].get("memory_fit")
    reference = work / f"uninterrupted_{tag}"
    second = None
    if rc == 0 and (run / f"checkpoint-{last}").is_dir():
        (run / f"checkpoint-{last}").rename(reference)  # the uninterrupted run's last checkpoint, kept aside
        rc, secs, tail = sh(launch([*common, f"train.resume_from_checkpoint={run}/checkpoint-{save}", "export.format=hf",
                                    f"export.output_dir={export}"]), out / f"cards_{tag}_resume.log", limit)
        rec["commands"]["resume_export"] = {"rc": rc, "s": secs, **({"tail": tail} if rc else {})}
        second = read_run(run)
        rec["phases"] = phase_table(first, second)
        if rc == 0 and (run / f"checkpoint-{last}").is_dir():
            # A compressed tensor's `.name` entry is its label (which name of a tied pair it was saved
            # under), not its bytes: compared apart.
            a, b = checkpoint_tensors(reference), checkpoint_tensors(run / f"checkpoint-{last}")
            rec["resume_labels_differing"] = sorted(k for k in a if k.endswith(".name") and a[k] != b.get(k))
            a = {k: v for k, v in a.items() if not k.endswith(".name")}
            b = {k: v for k, v in b.items() if not k.endswith(".name")}
            rec["resume_bit_identical"] = a == b and len(a) > 0
            rec["resume_tensors_compared"] = len(a)
            differing = sorted(k for k in a if a[k] != b.get(k))
            rec["resume_tensors_differing_count"] = len(differing)  # the list below is cut at 10
            rec["resume_tensors_differing"] = differing[:10]
            if differing and not SMOKE:  # do the values differ, or only their encoding? (the first 40 blobs)
                rec["resume_decoded_differences"] = decoded_differences(reference, run / f"checkpoint-{last}", differing[:40])
        rec["summary_resume"] = {k: v for k, v in second["summary"].items() if not isinstance(v, (dict, list))}
        flush()
    if (export / "config.json").exists():  # the resumed run wrote its export: generate from it
        prompt = ["--prompt", "def ", "--raw", "--max-new-tokens", "16", *(["--device", "cpu"] if SMOKE else [])]
        gen = ["neutrain", "generate", str(export), *prompt, "--device-budget-gib", str(budget)]
        said = out / f"cards_{tag}_generate.txt"
        rc, secs, tail = sh(gen, out / f"cards_{tag}_generate.log", limit, stdout=said)
        rec["commands"]["generate"] = {"rc": rc, "s": secs, "tail": tail}
        peak = [line for line in tail.splitlines() if line.startswith("generate: peak GPU memory")]
        rec["generate_peak"] = peak[-1] if peak else None
        rec["generate_form"] = next((line for line in tail.splitlines() if line.startswith("generate: ") and
                                     "peak GPU memory" not in line), None)
        # The reference: the same export with no budget (dense on the card, or as it is on a CPU).
        dense_said = out / f"cards_{tag}_generate_dense.txt"
        rc, secs, tail = sh(["neutrain", "generate", str(export), *prompt], out / f"cards_{tag}_generate_dense.log",
                            limit, stdout=dense_said)
        rec["commands"]["generate_dense"] = {"rc": rc, "s": secs, **({"tail": tail} if rc else {})}
        rec["generate_text"] = said.read_text(errors="replace") if said.exists() else None
        rec["generate_equals_dense"] = bool(rec["generate_text"]) and rc == 0 and \
            rec["generate_text"] == dense_said.read_text(errors="replace")
    rec["summary_train"] = {k: v for k, v in first["summary"].items() if not isinstance(v, (dict, list))}
    rec["seconds"] = {"train": phase_seconds(first), **({"resume_export": phase_seconds(second)} if second else {})}
    rec["ok"] = all(c["rc"] == 0 for c in rec["commands"].values()) and len(rec["commands"]) == 4 \
        and rec.get("resume_bit_identical") is True and rec.get("generate_equals_dense") is True
    for path in (run, export, reference):  # the next budget needs the disk (an 8B checkpoint is ~10 GiB)
        shutil.rmtree(path, ignore_errors=True)
    return rec


def timing_run(name: str, work: Path, out: Path, limit: float) -> dict:
    budget, batch, extra = TIMING[name]
    run = work / f"timing_{name}"
    overrides = [f"train.micro_batch_size={batch}", *extra]
    cmd = launch([f"memory.device_budget_gib={budget}", *overrides, f"train.max_steps={TIMING_STEPS}",
                  "train.save_steps=1000", f"train.output_dir={run}"])
    rc, secs, tail = sh(cmd, out / f"cards_timing_{name}.log", limit)
    got = read_run(run)
    choice = got["summary"].get("memory_fit") or {}
    measured = tokens_per_s(got["steps"], 3)
    predicted = choice.get("predicted_tokens_per_s")
    rec = {"budget_gib": budget, "micro_batch_size": batch, "overrides": overrides, "rc": rc, "s": secs,
           "tokens_per_s": measured, "weights": choice.get("weights"), "predicted_tokens_per_s": predicted,
           "predicted_relative_error": round(predicted / measured - 1, 4) if predicted and measured else None,
           "choice": choice or None, "phases": phase_table(got),
           "summary": {k: v for k, v in got["summary"].items() if not isinstance(v, (dict, list))}}
    if rc:
        rec["tail"] = tail
    shutil.rmtree(run, ignore_errors=True)
    return rec


def targets_of(budgets: list[dict], timing: dict) -> tuple[dict, dict]:
    """The issue's targets (fixed names) and the figures they come from."""
    t, notes = {}, {}
    b8, b8_7 = timing.get("b8_none", {}).get("tokens_per_s"), timing.get("b8_7", {}).get("tokens_per_s")
    if b8 and b8_7:
        t["card_8gb_over_unbounded_tokens_per_s_batch8"] = {"value": round(b8_7 / b8, 3), "goal": ">= 0.9",
                                                            "met": b8_7 / b8 >= 0.9}
    b8_5 = timing.get("b8_5", {}).get("tokens_per_s")
    if b8 and b8_5:  # a 6 GB card at batch 8 (the MLP in chunks) against no budget, measured in the same call
        t["card_6gb_over_unbounded_tokens_per_s_batch8"] = {"value": round(b8_5 / b8, 3), "goal": ">= 0.9",
                                                            "met": b8_5 / b8 >= 0.9}
    b1 = timing.get("b1_none", {}).get("tokens_per_s")
    b11 = timing.get("b1_11", {}).get("tokens_per_s")
    if b1 and b11:
        t["card_12gb_over_unbounded_tokens_per_s"] = {"value": round(b11 / b1, 3), "goal": ">= 0.95", "met": b11 / b1 >= 0.95}
    dense = timing.get("b1_dense", {}).get("tokens_per_s")
    if b1 and dense:  # the shipped recipe (weights: auto) with no budget trains at dense speed
        t["auto_unbounded_over_dense_tokens_per_s_batch1"] = {"value": round(b1 / dense, 3), "goal": ">= 0.98",
                                                              "met": b1 / dense >= 0.98}
    if b11 and dense:  # a 12 GB card against dense on a card that holds it
        t["card_12gb_over_dense_unbounded_tokens_per_s_batch1"] = {"value": round(b11 / dense, 3), "goal": ">= 0.90",
                                                                   "met": b11 / dense >= 0.90}
    misses = [(abs(r["predicted_tokens_per_s"] / r["tokens_per_s"] - 1), name) for name, r in timing.items()
              if r.get("predicted_tokens_per_s") and r.get("tokens_per_s")]
    if misses:  # the fit's step-time model against every timing row it predicted
        worst = max(misses)
        t["fit_step_time_max_relative_error"] = {"value": round(worst[0], 3), "goal": "<= 0.15", "met": worst[0] <= 0.15,
                                                 "at": worst[1], "rows": len(misses)}
    generate = generate_target(timing)
    if generate:  # a budgeted generate against the dense one on a card that holds it, in the same call
        t[GENERATE_TARGET] = generate
    six = [b for b in budgets if b.get("budget_gib") == 5.0]
    if six:  # a 6 GB card: every command of the journey at 5 GiB, batch 1, resume bit-identical
        t["card_6gb_whole_run_ok"] = {"value": bool(six[0].get("ok")), "goal": True, "met": bool(six[0].get("ok"))}
    ratios, errors = [], []
    for b in budgets:
        phases = b.get("phases", {})
        step = phases.get("train_step", {}).get("measured", {}).get("reserved_gib")
        for name, entry in phases.items():
            meas, pred = entry["measured"].get("reserved_gib"), entry["predicted"].get("reserved_gib")
            if step and meas is not None:
                ratios.append((meas / step, b["budget_gib"], name))
            if meas and pred is not None:
                errors.append((abs(pred - meas) / meas, b["budget_gib"], name))
    if ratios:
        worst = max(ratios)
        t["max_phase_peak_over_train_step_peak"] = {"value": round(worst[0], 3), "goal": "<= 1.05", "met": worst[0] <= 1.05,
                                                    "at": {"budget_gib": worst[1], "phase": worst[2]}, "memory": "peak reserved"}
    if errors:
        worst = max(errors)
        t["planner_phase_max_relative_error"] = {"value": round(worst[0], 3), "goal": "<= 0.10", "met": worst[0] <= 0.10,
                                                 "at": {"budget_gib": worst[1], "phase": worst[2]}, "memory": "peak reserved"}
    return t, notes


def _missing_note(targets: dict, budgets: list[dict]) -> str | None:
    """What the parts did not measure, and which journeys failed: said beside the targets."""
    missing = [n for n in TARGETS if n not in targets]
    failed = [f"{b['budget_gib']:g} GiB ({', '.join(k for k, c in b['commands'].items() if c['rc'])} rc != 0)"
              for b in budgets if not b.get("ok")]
    parts = ([f"not measured in these parts: {', '.join(missing)}"] if missing else []) + \
        ([f"journeys not ok: {'; '.join(failed)}"] if failed else [])
    return "; ".join(parts) or None


def pcie4_projection(timing: dict) -> dict | None:
    """tok/s of the 8 GB run on a PCIe 4.0 x16 link: the step cannot be shorter than its bytes over the link."""
    rec = timing.get("b8_7")
    if not rec or not rec.get("tokens_per_s"):
        return None
    from neutrain.config import load_recipe
    from neutrain.memory import apply_changes, estimate_recipe

    # The configuration the run's fit chose (which layers' weights, whether the activations, are offloaded).
    recipe = load_recipe(str(ROOT / RECIPE), ["train.micro_batch_size=8"])
    changes = dict((rec.get("choice") or {}).get("changes") or {})
    if recipe.memory.weights == "auto":  # runs from before weights: auto ran the recipe's NeuZip weights
        changes.setdefault("memory.weights", rec.get("weights") or "neuzip-lossless")
    chosen = estimate_recipe(apply_changes(recipe, changes)).settings
    tokens = 8 * recipe.data.sequence_len
    step = tokens / rec["tokens_per_s"]
    # Saved layer inputs (activation offload): bf16 hidden states of every layer, out in forward, back in backward.
    acts = chosen.get("host_activation_bytes", 0)
    h2d = chosen.get("h2d_bytes_per_step", 0) + acts
    d2h = chosen.get("d2h_bytes_per_step", 0) + acts
    floor = max(h2d, d2h) / PCIE4_BYTES_PER_S
    return {"measured_step_s": round(step, 3), "h2d_gib": round(h2d / GIB, 2), "d2h_gib": round(d2h / GIB, 2),
            "link_floor_s": round(floor, 3), "tokens_per_s": round(tokens / max(step, floor), 1),
            "assumes": "copies overlap compute, as on the H100; 25 GB/s each direction"}


def main() -> int:
    global RECIPE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="all")
    ap.add_argument("--budgets", default="22,14.5,11,7")
    ap.add_argument("--timing", default=",".join(TIMING), help=f"comma list of {', '.join([*TIMING, *GENERATE])}")
    ap.add_argument("--work", default="/tmp/neutrain-cards")
    ap.add_argument("--limit", type=float, default=420, help="seconds one command may run")
    ap.add_argument("--merge", nargs="+", type=Path)
    ap.add_argument("--sharing", default="each journey and each timing run alone on its GPU",
                    help="with --merge: what ran beside what (NVML's device figure counts every process on a GPU)")
    ap.add_argument("--recipe", default=RECIPE)
    ap.add_argument("--smoke", action="store_true", help="CPU flow check with a tiny model (recipes/default.yaml)")
    args = ap.parse_args()
    RECIPE = args.recipe
    if args.smoke:
        RECIPE = "recipes/default.yaml" if args.recipe == ap.get_default("recipe") else args.recipe
        SMOKE.extend(["train.use_cpu=true", "data.sequence_len=64", "train.micro_batch_size=2", "train.logging_steps=1",
                      "eval.perplexity=false", "distill.enabled=false", "eval.sample_tokens=4"])
    out = Path(os.environ.get("OUT", "/tmp/neutrain-cards-out"))
    out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        from benchmarks._common import write_result

        parts = [json.loads(p.read_text()) for p in args.merge if p.exists()]
        budgets = sorted((b for p in parts for b in p["budgets"] if b), key=lambda b: -b["budget_gib"])
        timing = {k: v for p in parts for k, v in p["timing"].items()}
        targets, _ = targets_of(budgets, timing)
        results = {"budgets": budgets, "timing": timing, "pcie4_8gb": pcie4_projection(timing),
                   "all_ok": all(b.get("ok") for b in budgets) and GATE_BUDGETS <= {b["budget_gib"] for b in budgets},
                   "gpus": sorted({p["gpu"] for p in parts})}
        write_result("cards", {"recipe": RECIPE, "steps": "22 (save at 20), resume 20->22, export hf, generate 16 tokens",
                               "stochastic_rounding": False, "timing_steps": TIMING_STEPS, "parts": [p["part"] for p in parts],
                               "sharing": args.sharing},
                     results, targets=targets, targets_note=_missing_note(targets, budgets), measured_on=parts[0].get("measured_on") or
                     {"device": parts[0]["gpu"], "cuda": None, "versions": None} if parts else None)
        print(json.dumps({"targets": targets, "all_ok": results["all_ok"]}, indent=1))
        return 0
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (smoke)"
    from benchmarks._common import environment

    measured_on = {k: v for k, v in environment().items() if k in ("device", "cuda", "versions", "date")}
    record = {"part": args.part, "gpu": gpu, "measured_on": measured_on, "budgets": [], "timing": {}}
    dest = out / f"cards_{args.part}.json"
    for budget in [float(b) for b in args.budgets.split(",") if b]:  # the gate first, then the targets' timing
        rec: dict = {}
        record["budgets"].append(rec)
        budget_run(budget, work, out, args.limit, rec, lambda: dest.write_text(json.dumps(record, indent=1)))
        print(f"budget {budget:g}:", {k: rec.get(k) for k in ("ok", "tokens_per_s", "resume_bit_identical", "generate_peak")},
              {k: (c["rc"], c["s"]) for k, c in rec["commands"].items()}, flush=True)
        dest.write_text(json.dumps(record, indent=1))
    for name in [n for n in args.timing.split(",") if n]:
        record["timing"][name] = {"rc": None, "note": "started, not finished"}
        dest.write_text(json.dumps(record, indent=1))
        record["timing"][name] = (generate_run(name, RECIPE, work, out, args.limit, sh, bool(SMOKE)) if name in GENERATE
                                  else timing_run(name, work, out, args.limit))
        print(name, {k: v for k, v in record["timing"][name].items() if k not in ("phases", "summary")}, flush=True)
        record["targets"] = targets_of(record["budgets"], record["timing"])[0]  # what this part's runs give
        dest.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
