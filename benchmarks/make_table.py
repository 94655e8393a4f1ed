"""Generate the README's results table from ``benchmarks/results/*.json``.

    python benchmarks/make_table.py          # rewrite the table between the README markers
    python benchmarks/make_table.py --check  # exit 1 if the README is out of date

Each result file may carry ``results["headline"]``: a short string with the
numbers that matter (the benchmark writes it from what it measured). The table
never holds a number that is not in a result file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def _attention(res) -> str | None:
    """Forward TOPS range per method, from the benchmark's rows."""
    if not isinstance(res, list):
        return None
    by: dict[str, list[float]] = {}
    for row in res:
        if isinstance(row, dict) and "fwd_tops" in row:
            by.setdefault(row["method"], []).append(row["fwd_tops"])
    if not by:
        return None
    return "fwd TOPS " + ", ".join(f"{m} {min(v):.0f}-{max(v):.0f}" for m, v in sorted(by.items()))


def _kv_eval(res) -> str | None:
    ctxs = (res or {}).get("throughput", {}).get("contexts") if isinstance(res, dict) else None
    if not ctxs:
        return None
    parts = []
    for n, caches in ctxs.items():
        for cache, row in caches.items():
            if "tokens_per_s" in row:
                parts.append(f"{int(n) // 1024}K {cache}: {row['tokens_per_s']:.0f} tok/s (batch {row['batch']})")
            elif "error" in row:
                parts.append(f"{int(n) // 1024}K {cache}: failed")
    return "; ".join(parts)


SUMMARIZERS = [_attention, _kv_eval]


def _headline(data: dict) -> str:
    res = data.get("results")
    if isinstance(res, dict) and isinstance(res.get("headline"), str):
        return res["headline"]
    if isinstance(data.get("headline"), str):
        return data["headline"]
    for summarize in SUMMARIZERS:
        text = summarize(res)
        if text:
            return text
    return "see JSON"


def table() -> str:
    rows = ["| benchmark | device | headline | commit | date | file |", "|---|---|---|---|---|---|"]
    for path in sorted(RESULTS.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        if not isinstance(data, dict) or "device" not in data:
            continue
        rows.append(
            f"| {data.get('name', path.stem)} | {data['device']} | {_headline(data)} | "
            f"{str(data.get('git_commit', '?'))[:8]} | {str(data.get('date', '?'))[:10]} | `benchmarks/results/{path.name}` |"
        )
    if len(rows) == 2:
        rows.append("| (no GPU results yet) | | | | | |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    text = README.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    new = text[:start] + "\n" + table() + "\n" + text[end:]
    if args.check:
        return 0 if new == text else 1
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
