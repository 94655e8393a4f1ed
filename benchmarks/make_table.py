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


def _headline(data: dict) -> str:
    res = data.get("results")
    if isinstance(res, dict) and isinstance(res.get("headline"), str):
        return res["headline"]
    if isinstance(data.get("headline"), str):
        return data["headline"]
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
