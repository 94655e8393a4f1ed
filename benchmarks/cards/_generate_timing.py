"""The cards benchmark's generate timing: ``neutrain generate`` under a device budget against the same export
dense and unbounded, one after the other in one call, as a user types them.

Why: under a budget that holds most of the model's compressed layers, generation keeps those on the card and
streams only the rest (:mod:`neutrain.memory.residency`); the figure that says whether that pays is its decode
rate against the dense model's on a card that holds it (``generate_9gib_over_dense_tokens_per_s``).

The export is the recipe's model with its random initialisation (``init: random``, as the recipe runs shape-only)
and a byte tokenizer, written once per timing run. Each ``neutrain generate`` prints its placement (the layers
kept and streamed, the predicted peak), its rate (``generate: N new tokens in S s (R tok/s, ...)``: the decode
of its prompt, prefill included, load not) and its peak memory; both decode greedily the same prompt and
must print the same text (every form is bit-exact).

Example:
    >>> rate_of(["generate: 128 new tokens in 9.84 s (13.0 tok/s, prefill included)"])
    13.0
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path
from typing import Callable

GENERATE = {"gen_9": 9.0}
"""Timing names -> the device budget (GiB) of the generate timed against the dense, unbounded one."""
NEW_TOKENS = 128
GOAL = 0.90
TARGET = "generate_9gib_over_dense_tokens_per_s"
_RATE = re.compile(r"^generate: (\d+) new tokens in ([\d.]+) s \(([\d.]+) tok/s")

EXPORT = r"""
import sys, torch
from transformers import AutoModelForCausalLM
from neutrain.config import load_recipe
from neutrain.data import byte_tokenizer
from neutrain.memory import config_only
recipe, path = sys.argv[1], sys.argv[2]
config = config_only(load_recipe(recipe).model)
torch.manual_seed(0)
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # the 8B initialises in seconds on a GPU
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.save_pretrained(path)
byte_tokenizer().save_pretrained(path)
"""


def rate_of(lines: list[str]) -> float | None:
    """The tok/s a ``neutrain generate`` printed (its ``generate: N new tokens in ...`` line), or None."""
    for line in lines:
        found = _RATE.match(line)
        if found:
            return float(found.group(3))
    return None


def generate_run(name: str, recipe: str, work: Path, out: Path, limit: float, sh: Callable, smoke: bool) -> dict:
    """Write the recipe's model as an export, then ``neutrain generate`` it under ``GENERATE[name]`` GiB and with
    no budget; the two rates, placements, peaks and texts. ``sh``: cards.py's runner (exit code, seconds, tail)."""
    budget, new = GENERATE[name], 16 if smoke else NEW_TOKENS  # the smoke checks the flow, not the rate
    export = work / f"export_{name}"
    rec: dict = {"budget_gib": budget, "new_tokens": new, "commands": {}}
    rc, secs, tail = sh([sys.executable, "-c", EXPORT, recipe, str(export)], out / f"cards_{name}_export.log", limit)
    rec["commands"]["export"] = {"rc": rc, "s": secs, **({"tail": tail} if rc else {})}
    if rc == 0:
        prompt = ["--prompt", "def ", "--raw", "--max-new-tokens", str(new), *(["--device", "cpu"] if smoke else [])]
        for key, extra in (("budget", ["--device-budget-gib", str(budget)]), ("dense", [])):
            said, log = out / f"cards_{name}_{key}.txt", out / f"cards_{name}_{key}.log"
            rc, secs, tail = sh(["neutrain", "generate", str(export), *prompt, *extra], log, limit, stdout=said)
            lines = log.read_text(errors="replace").splitlines()  # the placement line is early: the whole log
            rec["commands"][key] = {"rc": rc, "s": secs, "tail": tail}
            rec[key] = {"tokens_per_s": rate_of(lines),
                        "placement": next((l for l in lines if l.startswith("generate: ") and "GiB" in l
                                           and "peak GPU memory" not in l), None),
                        "peak": next((l for l in lines if l.startswith("generate: peak GPU memory")), None),
                        "text": said.read_text(errors="replace") if said.exists() else None}
        rec["same_text"] = all(rec.get(k, {}).get("text") for k in ("budget", "dense")) and \
            rec["budget"]["text"] == rec["dense"]["text"]
    shutil.rmtree(export, ignore_errors=True)
    return rec


def generate_target(timing: dict) -> dict | None:
    """``{value, goal, met}`` of the budgeted generate's rate over the dense one's, from one timing record."""
    for name, budget in GENERATE.items():
        rec = timing.get(name) or {}
        fast, slow = (rec.get("dense") or {}).get("tokens_per_s"), (rec.get("budget") or {}).get("tokens_per_s")
        if fast and slow:
            return {"value": round(slow / fast, 3), "goal": f">= {GOAL:.2f}", "met": slow / fast >= GOAL,
                    "budget_gib": budget, "tokens_per_s": {"budget": slow, "dense": fast},
                    "same_text": rec.get("same_text")}
    return None
