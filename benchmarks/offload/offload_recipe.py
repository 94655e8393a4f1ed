"""The 70B memory gate (a 70B trains on one card) from the literal recipe runs: ``offload.json``'s 70B targets.

``benchmarks/memory/gpu_70b_recipe.sh`` launches ``recipes/llama3_70b_offload.yaml`` as a user does (train with a
save, a resume of one step with a save, then ``neutrain export --format neuzip``); this reads what those
commands wrote (``metrics.jsonl``, ``summary.json``, the checkpoint and the export) and nvidia-smi's
samples of device memory in use, and writes them, with the targets ``h100_70b_tokens_per_s_16k`` and
``h100_70b_peak_reserved_gib``, into ``offload.json``: merged into the file of ``benchmarks/offload/offload.py``'s
parts when ``$OUT`` (or the offload table, ``benchmarks/offload/results.jsonl``) holds one.

    python benchmarks/offload/offload_recipe.py --train /tmp/llama3_70b_offload --resume /dev/shm/... --steps 4 --export /tmp/...
    python benchmarks/offload/offload_recipe.py --describe /tmp/llama3_70b_offload/checkpoint-4   # before it is deleted

The whole run at a device budget (train, resume, the uninterrupted run, the checkpoints compared, export and
generate; ``benchmarks/memory/_whole_run.py``) goes into ``70b_recipe_22gib`` with ``--whole-run <state folder>``,
with its host memory (``card_24gb_70b_host_gib``) and ``pcie4_projection``:

    python benchmarks/offload/offload_recipe.py --whole-run /tmp/neutrain-70b-state --train RUN --resume RUN2 \
        --straight RUN3 --budget 22 --export /tmp/llama3_70b_export
    python benchmarks/offload/offload_recipe.py --compare-manifests A/neutrain_manifest.json B/neutrain_manifest.json
    python benchmarks/offload/offload_recipe.py --bf16-gib /tmp/llama3_70b_export/config.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from benchmarks._common import read_run  # noqa: E402 (after the path is set)
from benchmarks.memory._whole_run import compare_manifests, llama_bf16_gib, whole_run  # noqa: E402

GIB = 2**30
TOKENS_PER_STEP = 16384  # recipes/llama3_70b_offload.yaml: micro_batch_size 1 x sequence_len 16384, packed


def device_used_gib(csv_path: Path | None) -> float | None:
    """Largest ``memory.used`` (MiB) nvidia-smi sampled during the runs, in GiB."""
    if csv_path is None or not csv_path.exists():
        return None
    used = []
    for line in csv_path.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[-1].replace(".", "", 1).isdigit():
            used.append(float(parts[-1]))
    return round(max(used) / 1024, 2) if used else None


def describe(directory: Path) -> dict:
    """Whether ``directory`` holds a saved model (files, and a ``config.json``), and its size in GiB."""
    files = [f for f in directory.rglob("*") if f.is_file()] if directory.is_dir() else []
    return {"saved": bool(files) and (directory / "config.json").exists(),
            "gib": round(sum(f.stat().st_size for f in files) / GIB, 2) if files else None,
            "safetensors_files": sum(f.suffix == ".safetensors" for f in files)}


def read_stages(path: Path | None) -> tuple[dict, dict]:
    """``(seconds, exit codes)`` by stage from the ``<stage>_s=`` / ``<stage>_rc=`` lines of gpu_70b_recipe.sh."""
    seconds, codes = {}, {}
    if path is None or not path.exists():
        return seconds, codes
    for key, value in (line.split("=", 1) for line in path.read_text().split() if "=" in line):
        stage, _, kind = key.rpartition("_")
        (codes if kind == "rc" else seconds)[stage] = int(value) if kind == "rc" else float(value)
    return seconds, codes


def summarise(run: dict, first_step: int) -> dict:
    """tok/s (median over the steps after the first of the launch: the first includes warm-up) and peaks."""
    steps = run["steps"]
    tps = [s["tokens_per_second"] for s in steps if "tokens_per_second" in s and s.get("step", 0) > first_step]
    out = {"steps_logged": [s.get("step") for s in steps],
           "tokens_per_s_each": [round(s["tokens_per_second"], 1) for s in steps if "tokens_per_second" in s],
           "tokens_per_s": round(statistics.median(tps), 1) if tps else None,
           "loss": [round(s["loss"], 4) for s in steps]}
    for key in ("peak_memory_gib", "peak_reserved_gib"):
        vals = [s[key] for s in run["records"] if key in s]
        if run["summary"] and key in run["summary"]:
            vals.append(run["summary"][key])
        out[key] = round(max(vals), 3) if vals else None
    if run["summary"]:
        out["summary"] = {k: v for k, v in run["summary"].items() if not isinstance(v, (dict, list))}
    return out


def write_record(part: str, results: dict, targets: dict, settings: dict, results_dir: Path | None,
                 replaces: str | None) -> None:
    """Put ``results`` into ``offload.json`` as ``part``: the parts benchmarks/offload/offload.py (or an earlier call) measured
    keep their place, each with the commit and date it was measured at; the earlier targets whose names start
    with ``replaces`` go (this run's ``targets`` stand for them; None: every earlier target stays)."""
    from benchmarks._common import read_record, write_result

    merged_results = {}
    # $OUT first: an earlier part of this device call wrote there; then the scratch directory or the table
    for base in (os.environ.get("OUT") or None, results_dir, None):
        if base is None and results_dir is not None:
            continue
        old = read_record("offload", base)
        if old is not None:
            merged_results = old.get("results", {})
            settings = {**old.get("settings", {}), **settings}
            # The record's commit and date are this run's: the parts it keeps say where they were measured.
            kept = settings.setdefault("kept_parts", {})
            kept.pop(part, None)  # this run measures it now
            for name in merged_results:
                if name != part and name not in kept:
                    kept[name] = {"git_commit": old.get("git_commit"), "date": old.get("date"), "device": old.get("device")}
            kept_targets = {k: v for k, v in old.get("targets", {}).items()
                            if replaces is None or not k.startswith(replaces)}
            targets = {**kept_targets, **targets}
            break
    merged_results[part] = results
    write_result("offload", settings, merged_results, targets=targets, out_dir=results_dir)


def _budget(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def _whole_run_main(args) -> int:
    runs = {name: read_run(path) for name, path in (("train", args.train), ("resume", args.resume),
                                                   ("straight", args.straight)) if path is not None}
    # The export may be gone by now (the uninterrupted run needed its disk): the script described it into a
    # JSON file first, and that file stands for it.
    exported = None if args.export is None else json.loads(args.export.read_text()) \
        if args.export.is_file() else describe(args.export)
    results, targets = whole_run(args.whole_run, runs, args.budget, exported)
    settings = {"recipe": "recipes/llama3_70b_offload.yaml", "steps": args.steps, "tokens_per_step": TOKENS_PER_STEP}
    ok = targets["card_24gb_70b_whole_run_ok"]["value"]
    if args.host_only:  # the training alone on a host stated smaller: its host memory, not the whole run's target
        targets.pop("card_24gb_70b_whole_run_ok")
        # Another card's training on the same host writes its part only: the host target is the 24 GB card's.
        own = args.budget == 22
        label = "unbounded" if args.budget is None else f"{args.budget:g}gib"
        write_record(f"70b_recipe_{label}_host", results, targets if own else {}, settings,
                     args.results_dir, "card_24gb_70b_host" if own else None)
        print(json.dumps({"targets": targets, "pcie4_projection": results["pcie4_projection"]}, indent=1))
        return 0 if results["stages"].get("train", {}).get("exit_code") == 0 else 1
    write_record("70b_recipe_22gib", results, targets, settings, args.results_dir, "card_24gb_70b_whole_run")
    print(json.dumps({"targets": targets, "failed_commands": results["failed_commands"],
                      "manifests_match": results["checkpoint_5_manifests"].get("match"),
                      "texts_same": results["generate"]["same"]}, indent=1))
    return 0 if ok else 1


CARD_SPEED_GOALS = {"card_24gb_70b_tokens_per_s_16k": (22.0, 0.95, None),
                    "card_12gb_70b_tokens_per_s_16k": (11.0, 0.90, 22.0)}
"""Each card's target: its budget, the share it must reach, and of what (None: the unbounded run; else the run at
that budget). Both compare runs of one device call: the parts named by budget in the offload.json files given."""


def steady_tokens_per_s(train_run: dict) -> float | None:
    """The median of the per-step rates after the first step (its warm-up: pinning, the first fetches), or the
    summary's whole-run rate when the steps carry none."""
    rates = [s["tokens_per_second"] for s in train_run.get("step_rates", []) if s.get("tokens_per_second")]
    rates = rates[1:] if len(rates) > 2 else rates
    return round(statistics.median(rates), 1) if rates else train_run.get("tokens_per_s")


def card_speeds(sources: list[str]) -> tuple[dict, dict]:
    """``(results, targets)`` from one call's host-only runs: each source is ``FILE:LABEL``, the part
    ``70b_recipe_<LABEL>_host`` of that ``offload.json`` (LABEL ``22gib``, ``11gib`` or ``unbounded``). Each
    budget's steady tok/s, and each card target as the share of the run it is held against (value: the share)."""
    runs: dict = {}
    for source in sources:
        path, _, label = str(source).rpartition(":")
        record = json.loads(Path(path).read_text())
        part = record.get("results", {}).get(f"70b_recipe_{label}_host")
        if part is None:
            raise SystemExit(f"--card-speeds {source}: {path} has no part 70b_recipe_{label}_host")
        train = part.get("runs", {}).get("train", {})
        runs[part.get("budget_gib")] = {"part": f"70b_recipe_{label}_host", "file": Path(path).name,
                                        "tokens_per_s": steady_tokens_per_s(train),
                                        "step_rates": [r.get("tokens_per_second") for r in train.get("step_rates", [])],
                                        "exit_code": part.get("stages", {}).get("train", {}).get("exit_code")}
    results = {"runs": {("unbounded" if b is None else f"{b:g}"): r for b, r in runs.items()}}
    targets = {}
    for name, (budget, share, against) in CARD_SPEED_GOALS.items():
        mine, base = runs.get(budget), runs.get(against)
        if not mine or not base or not mine["tokens_per_s"] or not base["tokens_per_s"]:
            continue
        value = round(mine["tokens_per_s"] / base["tokens_per_s"], 3)
        targets[name] = {"value": value, "goal": f">= {share}", "met": value >= share,
                         "tokens_per_s": mine["tokens_per_s"], "against_tokens_per_s": base["tokens_per_s"],
                         "source": f"recipes/llama3_70b_offload.yaml at memory.device_budget_gib={budget:g} against "
                                   + ("no budget" if against is None else f"{against:g} GiB") + ", one device call"}
    return results, targets


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--describe", type=Path, help="print what a checkpoint directory holds (JSON) and exit")
    ap.add_argument("--compare-manifests", type=Path, nargs=2, metavar=("FIRST", "SECOND"),
                    help="print whether two manifests list the same tensors with the same sha256 (JSON) and exit")
    ap.add_argument("--bf16-gib", type=Path, metavar="CONFIG", help="print a Llama config's dense bf16 size in GiB")
    ap.add_argument("--whole-run", type=Path, metavar="STATE",
                    help="the whole run's state folder: write offload.json's 70b_recipe_22gib")
    ap.add_argument("--host-only", action="store_true",
                    help="with --whole-run: the train stage alone (HOST_LIMIT_GIB): write 70b_recipe_22gib_host with "
                         "card_24gb_70b_host_gib, leaving the whole run's part and target as they are")
    ap.add_argument("--card-speeds", nargs="+", metavar="FILE:LABEL",
                    help="one call's host-only runs, each the part 70b_recipe_<LABEL>_host of an offload.json (LABEL "
                         "22gib, 11gib, unbounded): write card_24gb_70b_tokens_per_s_16k and card_12gb_70b_tokens_per_s_16k")
    ap.add_argument("--train", type=Path)
    ap.add_argument("--resume", type=Path)
    ap.add_argument("--straight", type=Path, help="the uninterrupted run's directory (--whole-run)")
    ap.add_argument("--budget", type=_budget, default=22.0,
                    help="memory.device_budget_gib of the whole run (none: no budget)")
    ap.add_argument("--export", type=Path,
                    help="the `neutrain export --format neuzip` directory, or the JSON --describe printed of it")
    ap.add_argument("--results-dir", type=Path, help="a scratch directory where offload.json is merged and written (default: the offload table, "
                    "benchmarks/offload/results.jsonl)")
    ap.add_argument("--checkpoint-record", type=Path,
                    help="--describe's output for the first run's checkpoint, written before it was deleted")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--nvsmi", type=Path)
    ap.add_argument("--stages", type=Path, help="key=seconds lines written by gpu_70b_recipe.sh")
    args = ap.parse_args()
    if args.describe is not None:
        print(json.dumps(describe(args.describe)))
        return 0
    if args.compare_manifests is not None:
        result = compare_manifests(*args.compare_manifests)
        print(json.dumps(result))
        return 0 if result["match"] else 1
    if args.bf16_gib is not None:
        try:
            print(llama_bf16_gib(json.loads(args.bf16_gib.read_text())))
        except (OSError, ValueError, KeyError) as exc:
            ap.error(f"--bf16-gib {args.bf16_gib}: {type(exc).__name__}: {exc}")
        return 0
    if args.card_speeds:
        results, targets = card_speeds(args.card_speeds)
        write_record("70b_card_speeds", results, targets, {"recipe": "recipes/llama3_70b_offload.yaml"},
                     args.results_dir, None)
        print(json.dumps({"results": results, "targets": targets}, indent=1))
        return 0 if targets else 1
    if args.whole_run is not None:
        return _whole_run_main(args)
    if args.train is None or args.resume is None:
        ap.error("--train and --resume are required (or --describe, --compare-manifests, --bf16-gib, --whole-run)")

    train, resume = read_run(args.train), read_run(args.resume)
    checkpoint = args.train / f"checkpoint-{args.steps}"
    saved = describe(checkpoint)
    if not saved["saved"] and args.checkpoint_record and args.checkpoint_record.exists():
        saved = json.loads(args.checkpoint_record.read_text())  # deleted after the resume to make room
    exported = describe(args.export) if args.export else {"saved": False, "gib": None}
    seconds, codes = read_stages(args.stages)
    results = {
        "train": summarise(train, first_step=1),
        "resume": summarise(resume, first_step=args.steps + 1),
        "checkpoint_saved": saved["saved"],
        "checkpoint_gib": saved["gib"],
        "resumed_steps": [s.get("step") for s in resume["steps"]],
        "resumed_checkpoint_saved": describe(args.resume / f"checkpoint-{args.steps + 1}")["saved"],
        "export_neuzip": exported,
        "device_used_gib": device_used_gib(args.nvsmi),
        "stage_seconds": seconds,
        "stage_exit_codes": codes,
    }
    ok = (results["checkpoint_saved"] and len(train["steps"]) >= args.steps
          and results["resumed_steps"] == [args.steps + 1] and exported["saved"]
          and codes.get("train") == 0 and codes.get("resume") == 0 and codes.get("export") == 0)
    results["gate_ok"] = ok
    tps = results["train"]["tokens_per_s"]
    reserved = max(v for v in (results["train"]["peak_reserved_gib"], results["resume"]["peak_reserved_gib"], 0) if v is not None)
    targets = {}
    if tps is not None:
        targets["h100_70b_tokens_per_s_16k"] = {"value": tps, "goal": ">= 620", "met": tps >= 620,
                                                "source": "recipes/llama3_70b_offload.yaml, literal launch"}
    if reserved:
        targets["h100_70b_peak_reserved_gib"] = {"value": round(reserved, 2), "goal": "<= 70", "met": reserved <= 70,
                                                 "source": "recipes/llama3_70b_offload.yaml, literal launch"}
    settings = {"recipe": "recipes/llama3_70b_offload.yaml", "steps": args.steps, "tokens_per_step": TOKENS_PER_STEP}
    write_record("70b_recipe", results, targets, settings, args.results_dir, "h100_70b")
    print(json.dumps({"targets": targets, "gate_ok": ok, "device_used_gib": results["device_used_gib"]}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
