"""The 70B whole run at a device budget: what ``benchmarks/memory/gpu_70b_recipe.sh`` left in its state folder, read into
``offload.json``'s ``70b_recipe_22gib`` and the target ``card_24gb_70b_whole_run_ok``.

The run is train (save at step 4), resume to step 5 (save), the uninterrupted 5-step run (save), a comparison of
the two checkpoint-5 by their manifests' per-tensor sha256, a NeuZip export of the resumed one, and generate from
the export under the budget and without one. The target holds only when every command exited 0, the two
checkpoints hold the same tensors byte for byte, and the two greedy texts are the same (and not empty).

Host memory (``card_24gb_70b_host_gib``, goal <= 100: a 128 GB workstation's share): the training run's peak
resident size plus the peak of torch's pinned host allocator, from its ``summary.json`` (``host_memory``,
:func:`neutrain.trainer.run_files.host_memory_stats`; an upper bound where the pinned pages are also resident),
else the sampled VmHWM of the train stage; beside it the host memory used above the idle machine's, as sampled,
and the fit's prediction. Run it on a host stated to have 100 GiB (``HOST_LIMIT_GIB=100``) so the fit must
split the layer inputs. ``pcie4_projection``: the training run's measured bytes over PCIe per step, each way,
and the step a PCIe 4.0 x16 link (25 GB/s each way) would allow at the least (copies overlapping compute, as
measured on the H200; the activation file's disk time does not depend on the link).

State folder (all written by the script; any may be missing when a stage did not run):

    70b_stages.txt              <stage>_s=<seconds> and <stage>_rc=<exit code> lines
    samples.csv                 stage,unix time,device MiB in use,host bytes used,largest VmHWM KiB of neutrain's
    70b_<stage>.log             each command's output (the fit's line is read from the runs')
    manifests.json              --compare-manifests' result
    generate_<budget|unbounded>.txt   each generate's stdout (the continuation)
    export_hf.txt               why the dense export did not run, when it did not
"""

from __future__ import annotations

import json
import re
from pathlib import Path

GIB = 2**30
PCIE4_BYTES_PER_S = 25e9  # a consumer card's PCIe 4.0 x16 link, each direction (benchmarks/cards/cards.py's)
HOST_GOAL_GIB = 100  # a 128 GB workstation, less what its own system and desktop take
TOKENS_PER_STEP = 16384  # recipes/llama3_70b_offload.yaml: micro_batch_size 1 x sequence_len 16384
RUNS = ("train", "resume", "straight")
COMMANDS = ("train", "resume", "straight", "export", "generate_budget", "generate_unbounded")
_FIT = re.compile(r"predicted peak ([\d.]+) GiB reserved in phase '(\w+)'(?:[^;]*?([\d.]+) GiB of host memory)?")
_GENERATE_PEAK = re.compile(r"generate: peak GPU memory ([\d.]+) GiB allocated, ([\d.]+) reserved, ([\d.]+) in use"
                            r"(?:.*?predicted ([\d.]+) reserved)?")


def manifest_tensors(manifest: dict) -> dict[str, str]:
    """``{file/tensor: sha256}`` over every safetensors file a manifest lists."""
    return {f"{rel}/{name}": sha for rel, entry in manifest.get("files", {}).items()
            for name, sha in entry.get("tensors", {}).items()}


def compare_manifests(first: Path, second: Path) -> dict:
    """Whether two checkpoints' manifests list the same tensors with the same sha256; the first few that differ."""
    try:
        a = manifest_tensors(json.loads(first.read_text()))
        b = manifest_tensors(json.loads(second.read_text()))
    except (OSError, ValueError) as exc:
        return {"match": False, "error": f"{type(exc).__name__}: {exc}"}
    differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    return {"match": bool(a) and not differ, "tensors": len(a), "differ_count": len(differ), "differ": differ[:5]}


def llama_bf16_gib(config: dict) -> float:
    """The dense bf16 size of a Llama-shaped model from its config (what ``--format hf`` writes), GiB."""
    h, i, layers, vocab = (int(config[k]) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    heads = int(config.get("num_attention_heads", 1))
    kv = int(config.get("num_key_value_heads", heads))
    kv_width = h // heads * kv
    per_layer = 2 * h * h + 2 * h * kv_width + 3 * h * i + 2 * h
    embeddings = vocab * h * (1 if config.get("tie_word_embeddings") else 2)
    return round((layers * per_layer + embeddings + h) * 2 / GIB, 2)


def read_stages(path: Path) -> dict[str, dict]:
    """``{stage: {"seconds", "exit_code"}}`` from ``<stage>_s=`` / ``<stage>_rc=`` lines (the last of each wins)."""
    stages: dict[str, dict] = {}
    if not path.exists():
        return stages
    for key, value in (line.split("=", 1) for line in path.read_text().split() if "=" in line):
        stage, _, kind = key.rpartition("_")
        if kind in ("s", "rc"):
            stages.setdefault(stage, {})["seconds" if kind == "s" else "exit_code"] = \
                float(value) if kind == "s" else int(value)
    return stages


def read_samples(path: Path) -> dict[str, dict]:
    """Per stage, the largest device memory in use, host memory used, and neutrain process peak resident (GiB)."""
    peaks: dict[str, dict] = {}
    if not path.exists():
        return peaks
    for line in path.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue
        stage, values = parts[0], []
        for raw, scale in zip(parts[2:], (1024, GIB, 2**20)):
            try:
                values.append(float(raw) / scale)
            except ValueError:
                values.append(None)
        entry = peaks.setdefault(stage, {})
        for key, value in zip(("device_used_gib", "host_used_gib", "process_peak_rss_gib"), values):
            if value is not None:
                entry[key] = round(max(entry.get(key, 0.0), value), 2)
    return peaks


def fit_line(log: Path) -> dict | None:
    """The planner's prediction from a run's memory line: peak reserved, its phase, and host memory (GiB)."""
    if not log.exists():
        return None
    for line in log.read_text(errors="replace").splitlines():
        match = _FIT.search(line) if line.lstrip().startswith("memory:") else None
        if match:
            out = {"predicted_reserved_gib": float(match.group(1)), "phase": match.group(2), "line": line.strip()}
            if match.group(3):
                out["predicted_host_gib"] = float(match.group(3))
            return out
    return None


def run_memory(summary: dict) -> dict:
    """Each phase's measured peaks beside the planner's, and the run's host memory, from its ``summary.json``."""
    fit = summary.get("memory_fit") or {}
    keep = ("peak_allocated_gib", "peak_reserved_gib", "device_used_gib", "predicted_reserved_gib",
            "predicted_device_gib", "seconds")
    return {"phases": {name: {k: v for k, v in entry.items() if k in keep}
                       for name, entry in (summary.get("phase_memory") or {}).items()},
            "peak_rss_gib": summary.get("peak_rss_gib"), "predicted_pinned_host_gib": fit.get("host_gib"),
            "host_memory": summary.get("host_memory"), "activation_tiers": fit.get("activation_tiers"),
            "steps": summary.get("steps"), "tokens_per_s": summary.get("tokens_per_second")}


def idle_host_used(path: Path) -> float | None:
    """Host memory used (GiB) at the first sample, before the first command started."""
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 5:
            try:
                return float(parts[3]) / GIB
            except ValueError:
                return None
    return None


def host_target(train: dict | None, samples: dict[str, dict], idle: float | None = None) -> dict:
    """``card_24gb_70b_host_gib``: the training run's host memory (see the module docstring); ``idle``: the host
    memory used before the first command (GiB)."""
    host = (train or {}).get("host_memory") or {}
    sampled = samples.get("train", {})
    if host.get("peak_rss_gib") is not None:
        value, source = host["peak_rss_gib"] + host.get("host_pinned_peak_gib", 0.0), "summary.json host_memory: " \
            "peak_rss_gib + host_pinned_peak_gib"
    elif sampled.get("process_peak_rss_gib") is not None:
        value, source = sampled["process_peak_rss_gib"], "samples.csv: the train stage's largest VmHWM"
    else:
        return {"value": None, "goal": f"<= {HOST_GOAL_GIB}", "met": False, "source": "not measured"}
    return {"value": round(value, 2), "goal": f"<= {HOST_GOAL_GIB}", "met": value <= HOST_GOAL_GIB, "source": source,
            "host_used_above_idle_gib": None if idle is None or sampled.get("host_used_gib") is None
            else round(sampled["host_used_gib"] - idle, 2),
            "predicted_pinned_gib": (train or {}).get("predicted_pinned_host_gib")}


def pcie4_projection(train: dict | None) -> dict | None:
    """The training run's bytes over PCIe per step, each way, and tok/s on a PCIe 4.0 x16 link: the step cannot
    be shorter than its bytes over the link (as ``benchmarks/cards/cards.py``'s projection for the 8B)."""
    host, steps, tps = (train or {}).get("host_memory") or {}, (train or {}).get("steps"), (train or {}).get("tokens_per_s")
    if not host or not steps or not tps:
        return None
    h2d, d2h = host["link_h2d_gib"] * GIB / steps, host["link_d2h_gib"] * GIB / steps
    step = TOKENS_PER_STEP / tps
    floor = max(h2d, d2h) / PCIE4_BYTES_PER_S
    return {"measured_step_s": round(step, 3), "h2d_gib_per_step": round(h2d / GIB, 2),
            "d2h_gib_per_step": round(d2h / GIB, 2), "link_floor_s": round(floor, 3),
            "tokens_per_s": round(TOKENS_PER_STEP / max(step, floor), 1),
            "activation_file_gib_per_step": round(host.get("activation_file_written_gib", 0.0) / steps, 2),
            "assumes": "copies overlap compute, as on the H200; 25 GB/s each direction; the disk's time unchanged"}


def generate_result(state: Path) -> dict:
    """Both generates' texts, whether they are the same, and each one's peak line."""
    out: dict = {}
    for kind in ("budget", "unbounded"):
        text = state / f"generate_{kind}.txt"
        out[f"{kind}_text"] = text.read_text().strip() if text.exists() else None
        log = state / f"70b_generate_{kind}.log"
        match = _GENERATE_PEAK.search(log.read_text(errors="replace")) if log.exists() else None
        if match:
            out[f"{kind}_peak"] = {"peak_allocated_gib": float(match.group(1)), "peak_reserved_gib": float(match.group(2)),
                                   "device_used_gib": float(match.group(3)),
                                   "predicted_reserved_gib": float(match.group(4)) if match.group(4) else None}
    out["same"] = bool(out["budget_text"]) and out["budget_text"] == out["unbounded_text"]
    return out


def whole_run(state: Path, runs: dict[str, dict], budget: float, exported: dict | None) -> tuple[dict, dict]:
    """``(results, targets)``: the ``70b_recipe_22gib`` record and its target, from ``state`` and the three runs'
    ``read_run`` (``runs``: train, resume, straight)."""
    stages = read_stages(state / "70b_stages.txt")
    manifests = json.loads((state / "manifests.json").read_text()) if (state / "manifests.json").exists() \
        else {"match": False, "error": "not compared"}
    hf_note = state / "export_hf.txt"
    results = {
        "budget_gib": budget,
        "stages": stages,
        "total_seconds": round(sum(s.get("seconds", 0.0) for s in stages.values()), 1),
        "runs": {name: {"steps": [s.get("step") for s in run["steps"]], **run_memory(run["summary"]),
                        "step_rates": [{"step": s.get("step"), "tokens_per_second": s.get("tokens_per_second")}
                                       for s in run["steps"]],
                        "fit": fit_line(state / f"70b_{name}.log")} for name, run in runs.items()},
        "samples": read_samples(state / "samples.csv"),
        "checkpoint_5_manifests": manifests,
        "export_neuzip": exported,
        "export_hf": hf_note.read_text().strip() if hf_note.exists() else stages.get("export_hf"),
        "generate": generate_result(state),
    }
    failed = [c for c in (*COMMANDS, *(("export_hf",) if "export_hf" in stages else ()))
              if stages.get(c, {}).get("exit_code") != 0]
    ok = not failed and bool(manifests.get("match")) and results["generate"]["same"]
    results["failed_commands"] = failed
    train = results["runs"].get("train")
    results["pcie4_projection"] = pcie4_projection(train)
    targets = {"card_24gb_70b_whole_run_ok": {
        "value": ok, "goal": True, "met": ok,
        "source": "benchmarks/memory/gpu_70b_recipe.sh: recipes/llama3_70b_offload.yaml at "
                  + ("no budget" if budget is None else f"memory.device_budget_gib={budget:g}")},
        "card_24gb_70b_host_gib": host_target(train, results["samples"], idle_host_used(state / "samples.csv"))}
    return results, targets
