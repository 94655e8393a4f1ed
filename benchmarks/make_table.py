"""Generate the documentation's results tables from the current rows of ``benchmarks/<topic>/results.jsonl``.

    python benchmarks/make_table.py          # rewrite every table between its markers
    python benchmarks/make_table.py --check  # exit 1 if any page is out of date

The tables live in ``docs/``, each between ``<!-- <name>:begin -->`` and
``<!-- <name>:end -->`` (:data:`SECTIONS` says which page holds which): the table of
every record in ``docs/results.md``, and the tables of single benchmarks on the page
of their topic. A page that has lost its markers is an error, so a table cannot
silently stop being written.

Each record may carry ``results["headline"]``: a short string with the
numbers that matter (the benchmark writes it from what it measured). The table
never holds a number that is not in a current row (``benchmarks/records.py`` says
which row of a name is current).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import records  # noqa: E402
DOCS = ROOT / "docs"
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


def _kv_fidelity(res) -> str | None:
    """Accuracy (and measured compression) of each cache on the trained retrieval model."""
    caches = (res or {}).get("fidelity", {}).get("caches") if isinstance(res, dict) else None
    if not caches:
        return None
    parts = []
    for label, summary in caches.items():
        overall = summary.get("overall", {})
        if "accuracy" in overall:
            ratio = overall.get("compression_ratio")
            parts.append(f"{label} {overall['accuracy']:.0f}%" + (f" ({ratio:.2f}x)" if ratio and label != "full" else ""))
    return "exact match: " + ", ".join(parts) if parts else None


def _multi_gpu(res) -> str | None:
    """Tokens/s and peak memory per GPU of each (mode, GPUs) run of benchmarks/multi_gpu/multi_gpu.py."""
    rows = res if isinstance(res, list) else [res] if isinstance(res, dict) else []
    rows = [r for r in rows if isinstance(r, dict) and "mode" in r and "tokens_per_s_per_gpu" in r]
    if not rows:
        return None
    return "; ".join(f"{r['mode']} x{r['gpus']}: {r['tokens_per_s_per_gpu']:.0f} tok/s/GPU, "
                     f"{r['peak_allocated_gib_per_gpu']:.2f} GiB/GPU" for r in rows)


SUMMARIZERS = [_attention, _kv_eval, _kv_fidelity, _multi_gpu]


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
    targets = data.get("targets")
    if isinstance(targets, dict) and targets:
        return "; ".join(f"{name} {_fmt(t.get('value'))} (goal {t.get('goal')})" for name, t in targets.items())
    return "see JSON"


def _fmt(value) -> str:
    return f"{value:,.4g}" if isinstance(value, float) else str(value)


def table() -> str:
    rows = ["| benchmark | device | headline | commit | date | file |", "|---|---|---|---|---|---|"]
    # every current benchmark record; the diagnostics' profiles are read from their notes, not listed here
    current = [r for r in records.rows() if r.get("current") and not str(r.get("source", "")).startswith("profiles/")]
    for data in sorted(current, key=lambda r: r["name"]):
        if "device" not in data:
            continue
        rows.append(
            f"| {data['name']} | {data['device']} | {_headline(data)} | "
            f"{str(data.get('git_commit', '?'))[:8]}{' (dirty)' if data.get('git_dirty') else ''} | "
            f"{str(data.get('date', '?'))[:10]} | `benchmarks/{records.topic_of(data['name'])}/results.jsonl` |"
        )
    if len(rows) == 2:
        rows.append("| (no GPU results yet) | | | | | |")
    return "\n".join(rows)


def _result(name: str) -> dict | None:
    """The current record of ``name``, or None when that benchmark has not run."""
    return records.current(name)


TM_BEGIN, TM_END = "<!-- train_memory:begin -->", "<!-- train_memory:end -->"
TM_LABELS = {
    "a": "(a) dense + AdamW, Hugging Face Trainer", "b": "(b) dense + SGD, full gradients", "c": "(c) dense + fused LOMO",
    "d": "(d) NeuZip lossless + fused LOMO", "e": "(e) NeuZip lossless + AdaLomo", "h": "Hugging Face Trainer, optim=\"lomo\"",
    "f": "(f) dense + fused AdaLomo", "g": "(g) as (d), decode buffers not reserved (A/B)",
    "q": "(q) as (d), side-stream decode-ahead on (A/B)",
    "x": "(x) as (c), eager update instead of the fused_update kernel (A/B)",
    "p": "Hugging Face Trainer, optim=\"paged_adamw_8bit\" (bitsandbytes)",
    "t": "torchao AdamW8bit stepped in backward (torchtune's setting)",
}


def train_memory_table() -> str | None:
    """The per-variant table of benchmarks/memory/results.jsonl#train_memory (docs/memory.md)."""
    data = _result("train_memory")
    if data is None:
        return None
    rows = [f"Measured on an {data['device']} (commit {str(data.get('git_commit'))[:8]}), Llama-3-8B architecture, sequence 1024, activation checkpointing:", "",
            "| variant | peak allocated, batch 1 | reserved | device used (NVML) | planner: allocated / reserved | tokens/s, batch 8 |",
            "|---|---|---|---|---|---|"]
    base = next((r for r in data["results"]["variants"] if r["variant"] == "c"), {}).get("batch8", {}).get("tokens_per_s")
    for r in data["results"]["variants"]:
        b1, b8 = r.get("batch1", {}), r.get("batch8", {})
        mem = "OOM" if b1.get("oom") else (f"{b1['peak_allocated_gib']:.2f} GiB" if "peak_allocated_gib" in b1 else "failed")
        tps = f"{b8['tokens_per_s']:,.0f}" if "tokens_per_s" in b8 else "-"
        if base and "tokens_per_s" in b8 and r["variant"] in ("d", "e"):
            tps += f" ({b8['tokens_per_s'] / base:.2f}x of c)"
        plan = f"{b1['planner_gib']:.2f} GiB" if "planner_gib" in b1 else "-"
        if "planner_reserved_gib" in b1:
            plan = f"{b1['planner_gib']:.2f} / {b1['planner_reserved_gib']:.2f} GiB"
        more = [f"{b1[k]:.2f} GiB" if b1.get(k) is not None else "-" for k in ("peak_reserved_gib", "device_used_gib")]
        rows.append(f"| {TM_LABELS.get(r['variant'], r['variant'])} | {mem} | {' | '.join(more)} | {plan} | {tps} |")
    return "\n".join(rows)


INF_BEGIN, INF_END = "<!-- inference:begin -->", "<!-- inference:end -->"


def inference_table() -> str | None:
    """Decode rows of benchmarks/decode/results.jsonl#inference (docs/export-and-inference.md)."""
    data = _result("inference")
    if data is None:
        return None
    res = data["results"]
    dense = res.get("decode", {}).get("dense-bf16", {})
    rows = [f"Measured on an {data['device']} (commit {str(data.get('git_commit'))[:8]}), Llama-3-8B architecture, "
            "random init, greedy decode after a 64-token prompt, transformers `DynamicCache`, eager (no CUDA graphs):",
            "", "| weights | weight memory | peak, batch 16 | tokens/s, batch 1 | tokens/s, batch 16 | GPU ms/step, batch 1 |",
            "|---|---|---|---|---|---|"]
    # Runs without "base_gib" predate the prefetcher fix (commit d325c1f): compressed models stayed alive,
    # so a row's peak also held the models measured before it. Only the first two rows (dense, then
    # lossless: nothing compressed before them) have a clean peak there; weight memory is a delta and exact.
    for i, (name, row) in enumerate(res.get("decode", {}).items()):
        if "batch1" not in row:
            rows.append(f"| {name} | {row.get('skipped') or row.get('error', 'failed')} | | | | |")
            continue
        ratio = f" ({row['weights_gib'] / dense['weights_gib']:.2f}x)" if dense.get("weights_gib") else ""
        gpu = row["batch1"].get("gpu_ms_per_step")
        peak = f"{row['batch16']['peak_gib']:.2f} GiB" if "base_gib" in row or i < 2 else "n/a (see note)"
        rows.append(f"| {name} | {row['weights_gib']:.2f} GiB{ratio} | {peak} | "
                    f"{row['batch1']['tokens_per_s']:.1f} | {row['batch16']['tokens_per_s']:.0f} | "
                    f"{'-' if gpu is None else f'{gpu:.1f}'} |")
    ppl = res.get("perplexity", {}).get("rows", {})
    if ppl:
        rows += ["", "Perplexity (held-out Python sources, small Llama trained by neutrain): " + ", ".join(
            f"{k} {v['perplexity']:.3f}" + (f" ({v['perplexity_change_pct']:+.2f}%)" if "perplexity_change_pct" in v else "")
            for k, v in ppl.items())]
    lora = res.get("lora_small", {}).get("rows", {})
    if lora:
        rows += ["", f"LoRA (r {res['lora_small']['settings']['lora_r']}, {res['lora_small']['settings']['steps']} steps, "
                 "same data) on that model, train loss over the last 10 steps / held-out loss after: " + ", ".join(
                     f"{k} {v['loss_last10']:.4f} / {v['heldout_loss_after']:.4f}" for k, v in lora.items() if "loss_last10" in v)]
    big = res.get("lora_8b", {})
    clean = any("base_gib" in row for row in res.get("decode", {}).values())
    if big:
        rows += ["", "LoRA on the 8B architecture (batch 2 x 512, random tokens; peak memory, tokens/s): " + ", ".join(
            f"{k} " + (f"{v['peak_gib']:.2f} GiB, " if clean else "") + f"{v['tokens_per_s']:.0f} tok/s"
            for k, v in big.items() if "tokens_per_s" in v)]
    if not clean:
        rows += ["", "Note: this run predates the fix that frees each compressed model before the next is built; "
                 "peaks after the second row (and LoRA peaks) included earlier models and are not shown."]
    return "\n".join(rows)


CONV_BEGIN, CONV_END = "<!-- convergence:begin -->", "<!-- convergence:end -->"


def convergence_table() -> str | None:
    """Held-out loss per optimizer and learning rate, from benchmarks/training/results.jsonl#convergence."""
    data = _result("convergence")
    if data is None:
        return None
    settings, runs = data["settings"], data["results"]["runs"]
    model = settings["model"]
    by: dict[str, dict[float, float]] = {}
    for r in runs:
        by.setdefault(f"{r['optimizer']}, {r['weights']}", {})[r["lr"]] = r["heldout_loss"]
    rows = [f"Measured on {data['device']} (commit {str(data.get('git_commit'))[:8]}): a {model['num_hidden_layers']}-layer, "
            f"{model['hidden_size']}-wide Llama from random init, {settings['steps']} steps, {settings['tokens']:,} tokens of "
            "Python stdlib source, cosine schedule, clipping 1.0; held-out loss after training (best rate in bold):", "",
            "| optimizer, weights | held-out loss at learning rate |", "|---|---|"]
    for label, losses in by.items():
        best = min(losses, key=losses.get)
        cells = [f"{lr:g}: " + (f"**{loss:.2f}**" if lr == best else f"{loss:.2f}") for lr, loss in sorted(losses.items())]
        rows.append(f"| {label} | {', '.join(cells)} |")
    return "\n".join(rows)


MG_BEGIN, MG_END = "<!-- multi_gpu:begin -->", "<!-- multi_gpu:end -->"


def multi_gpu_table() -> str | None:
    """Per-mode scaling rows of benchmarks/multi_gpu/results.jsonl#multi_gpu (docs/launching.md)."""
    data = _result("multi_gpu")
    if data is None:
        return None
    rows = [f"Measured on {data['device']} GPUs of one host (commit {str(data.get('git_commit'))[:8]}), Llama-3-8B "
            "architecture, random init, bf16, fused LOMO, activation checkpointing, sequence "
            f"{data['settings']['seq']} x micro-batch {data['settings']['micro_batch']} per GPU, median of "
            f"{data['settings']['steps']} steps after {data['settings']['warmup']} warm-up:", "",
            "| mode | GPUs | tokens/s per GPU | scaling vs 1 GPU | peak allocated per GPU | vs 1 GPU |", "|---|---|---|---|---|---|"]
    for r in data["results"]:
        rows.append(f"| {r['mode']} | {r['gpus']} | {r['tokens_per_s_per_gpu']:,.0f} | {100 * r['scaling_efficiency']:.0f}% | "
                    f"{r['peak_allocated_gib_per_gpu']:.2f} GiB | {r['memory_vs_1gpu']:.2f}x |")
    return "\n".join(rows)


def _missing(name: str) -> str:
    """What a table's place says when its result file is absent (never run, or archived as unreliable)."""
    topic = records.topic_of(name)
    return (f"No current result: `benchmarks/{topic}/results.jsonl` has no current `{name}` row (its archived rows "
            f"say why they were set aside). Run `benchmarks/{topic}/{name}.py` to regenerate this section.")


# A section whose result file is gone says so (``_missing``), rather than keeping numbers no file backs.
SECTIONS = [
    ("results.md", BEGIN, END, table),
    ("memory.md", CONV_BEGIN, CONV_END, lambda: convergence_table() or _missing("convergence")),
    ("memory.md", TM_BEGIN, TM_END, lambda: train_memory_table() or _missing("train_memory")),
    ("launching.md", MG_BEGIN, MG_END, lambda: multi_gpu_table() or _missing("multi_gpu")),
    ("export-and-inference.md", INF_BEGIN, INF_END, lambda: inference_table() or _missing("inference")),
]
"""(page in docs/, begin marker, end marker, the table's text)."""


def _replace(text: str, begin: str, end: str, body: str) -> str:
    start, stop = text.index(begin) + len(begin), text.index(end)
    return text[:start] + "\n" + body + "\n" + text[stop:]


def pages() -> dict[Path, tuple[str, str]]:
    """Each page that holds a table: (its text now, its text with every table regenerated).

    Raises SystemExit naming the page and marker when a page lacks a table's markers.
    """
    out: dict[Path, tuple[str, str]] = {}
    for name, begin, end, body in SECTIONS:
        path = DOCS / name
        old, new = out.get(path) or (path.read_text(), path.read_text())
        if begin not in new or end not in new:
            raise SystemExit(f"{path.relative_to(ROOT)} has no {begin} ... {end}: put the markers back where the table belongs")
        out[path] = (old, _replace(new, begin, end, body()))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    stale = {path: new for path, (old, new) in pages().items() if old != new}
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is stale: run `python benchmarks/make_table.py`", file=sys.stderr)
        return 1 if stale else 0
    for path, text in stale.items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
