"""From the attention benchmark's timed rows to the dispatch table's entries and ``attention.json``'s targets.

Pure Python over the rows ``benchmarks/attention/attention.py`` measures (no GPU), so the CPU tests can feed it
made-up rows. A row is one method at one (N, causal):

* ``sage_kernel`` / ``gluon_kernel``: one Sage forward kernel alone (``fwd_ms``, ``fwd_tops``) on inputs
  quantized once; ``quant_ms`` the quantization's own time;
* ``sage+<route>`` (Triton forward) and ``gluon+<route>`` (Gluon forward): ``sage_attention`` with that
  ``kernel`` and backward ``route``: ``fwd_ms`` (quantization included; the same for every route of one
  kernel) and ``fwd_bwd_ms``;
* ``sdpa_cudnn``, ``sdpa_flash``: torch SDPA on that backend, ``fwd_ms`` and ``fwd_bwd_ms``.

A row with ``skipped`` (a kernel that cannot run there, and why) is recorded but never compared.

Each table entry names the faster Sage kernel for its range (``"kernel"``) and says ``sage`` only where that
kernel beat cuDNN by the margin at both ends (:func:`neutrain.attention.dispatch.build_entries`, run once per
kernel: its entries carry no kernel, so the choice between kernels is made here, range by range).
"""

from __future__ import annotations

from neutrain.attention import dispatch

ATTENTION_GOALS = {"fwd_over_cudnn_min": ">= 1.3", "fwd_bwd_over_cudnn_min": ">= 1.05", "train_step_over_sdpa": ">= 1.03",
                   "sage_fwd_tops_n16k_d128": ">= 800"}
"""SageAttention's targets: GPU timings that ``benchmarks/attention/attention.py`` measures into ``attention.json``."""

KERNELS = dispatch.KERNELS
#: The forward rows of each kernel's own timing (no quantization), and the prefix of its sage_attention rows.
KERNEL_ROW = {"triton": "sage_kernel", "gluon": "gluon_kernel"}
METHOD_PREFIX = {"triton": "sage", "gluon": "gluon"}
#: Where the targets look: long sequences at head dim 128 (the 8B recipe's), causal and not.
TARGET_MIN_N, TARGET_HEAD_DIM, TOPS_N = 8192, 128, 16384
#: The training-step length whose ratio is ``train_step_over_sdpa`` (the 8B recipe's longest measured).
STEP_SEQ = "16384"


def method_name(kernel: str, route: str) -> str:
    """``sage+cudnn`` (Triton forward, cuDNN backward), ``gluon+cudnn``...

    Example:
        >>> method_name("gluon", "cudnn")
        'gluon+cudnn'
    """
    return f"{METHOD_PREFIX[kernel]}+{route}"


def by_point(rows: list[dict]) -> dict[tuple[int, bool], dict[str, dict]]:
    """``{(n, causal): {method: row}}`` of the rows that ran (skipped rows left out)."""
    out: dict[tuple[int, bool], dict[str, dict]] = {}
    for r in rows:
        if not r.get("skipped"):
            out.setdefault((r["n"], r["causal"]), {})[r["method"]] = r
    return out


def sage_rows(methods: dict[str, dict], kernel: str) -> dict[str, dict]:
    """``{route: row}`` of one kernel's ``sage_attention`` rows at one point."""
    prefix = METHOD_PREFIX[kernel] + "+"
    return {name[len(prefix):]: row for name, row in methods.items() if name.startswith(prefix)}


def kernel_times(methods: dict[str, dict], kernel: str, routes_allowed=None) -> dict | None:
    """One kernel at one point: ``{"fwd_ms", "fwd_bwd_ms", "backward"}`` (its fastest route among
    ``routes_allowed``, every measured one when None), or None."""
    routes = {route: row for route, row in sage_rows(methods, kernel).items()
              if "fwd_bwd_ms" in row and (routes_allowed is None or route in routes_allowed)}
    if not routes:
        return None
    best = min(routes, key=lambda route: routes[route]["fwd_bwd_ms"])
    return {"fwd_ms": routes[best]["fwd_ms"], "fwd_bwd_ms": routes[best]["fwd_bwd_ms"], "backward": best}


def _points(points: dict[tuple[int, bool], dict[str, dict]], causal: bool, kernel: str, mode: str,
            train_routes=None) -> list[dict]:
    key = "fwd_ms" if mode == "forward" else "fwd_bwd_ms"
    out = []
    for (n, c), methods in sorted(points.items()):
        times = kernel_times(methods, kernel, train_routes if mode == "train" else None)
        if c != causal or times is None or key not in methods.get("sdpa_cudnn", {}):
            continue
        out.append({"n": n, "sage_ms": times[key], "sdpa_ms": methods["sdpa_cudnn"][key],
                    "backward": times["backward"] if mode == "train" else "triton"})
    return out


def _min_speedup(entry: dict) -> float:
    return min(ev["speedup"] for ev in entry["evidence"])


def build_table(device: str, d: int, rows: list[dict], margin: float,
                train_routes=None) -> tuple[list[dict], dict]:
    """``(entries, left_out)``: dispatch entries per (causal, mode), each naming the faster Sage kernel.

    ``train_routes``: the backward routes a train entry may name (those that passed the fidelity gate on
    real activations, :func:`benchmarks.attention._attention_fidelity.route_fidelity`; every measured one when None):
    a faster route that loses accuracy must not be what ``auto`` trains with.

    Per (causal, mode), each kernel measured at every length Triton was gets its own entries from
    :func:`dispatch.build_entries`; a kernel missing at some of them is left out of that family (its
    ranges would not line up), said in ``left_out``. For each range the entry kept is a ``sage`` one
    if any kernel's is (the one with the largest worst-end speedup), else the kernel with the largest
    worst-end speedup (the faster Sage kernel, under SDPA). Every evidence point carries each kernel's
    Sage time (``sage_ms_by_kernel``).
    """
    points = by_point(rows)
    entries, left_out = [], {}
    for causal in (False, True):
        for mode in dispatch.MODES:
            per_kernel = {k: _points(points, causal, k, mode, train_routes) for k in KERNELS}
            lengths = [p["n"] for p in per_kernel["triton"]]
            ran = {}
            for kernel, pts in per_kernel.items():
                if pts and [p["n"] for p in pts] == lengths:
                    ran[kernel] = dispatch.build_entries(device, d, causal, "bfloat16", mode, pts, margin)
                elif pts and kernel != "triton":
                    left_out[f"causal={causal} {mode} {kernel}"] = (
                        f"measured at N={[p['n'] for p in pts]}, Triton at N={lengths}")
            if not ran:
                continue
            sage_ms = {k: {p["n"]: round(p["sage_ms"], 4) for p in per_kernel[k]} for k in ran}
            for i, first in enumerate(ran[next(iter(ran))]):
                candidates = {k: es[i] for k, es in ran.items()}
                winners = {k: e for k, e in candidates.items() if e["backend"] == "sage"} or candidates
                kernel = max(winners, key=lambda k: _min_speedup(winners[k]))  # first of KERNELS on a tie
                chosen = dict(winners[kernel], kernel=kernel)
                chosen["evidence"] = [dict(ev, sage_ms_by_kernel={k: sage_ms[k][ev["n"]] for k in ran})
                                      for ev in chosen["evidence"]]
                entries.append(chosen)
    return entries, left_out


def _entry_at(entries: list[dict], n: int, causal: bool, mode: str, d: int) -> dict | None:
    """The one-point entry of a measured length (the one dispatch consults first)."""
    return next((e for e in entries if e["head_dim"] == d and e["causal"] == causal and e["mode"] == mode
                 and e["seq_min"] == e["seq_max"] == n), None)


def goal_met(value: float | None, goal: str) -> bool | None:
    """Whether ``value`` meets a goal written ``">= x"`` (None when unmeasured).

    Example:
        >>> goal_met(1.31, ">= 1.3"), goal_met(None, ">= 1.3")
        (True, None)
    """
    if value is None:
        return None
    op, _, bound = goal.partition(" ")
    if op != ">=":
        raise ValueError(f"goal {goal!r}: only '>= x' goals are read")
    return value >= float(bound)


def _target(name: str, value: float | None, method: str, note: str | None = None, **extra) -> dict:
    goal = ATTENTION_GOALS[name]
    out = {"value": None if value is None else round(value, 4), "goal": goal, "met": goal_met(value, goal),
           "method": method, **extra}
    if note:
        out["note"] = note
    return out


def _ratio_target(name: str, points, entries, d: int, mode: str) -> dict:
    key = "fwd_ms" if mode == "forward" else "fwd_bwd_ms"
    per_point = []
    for (n, causal), methods in sorted(points.items()):
        entry = _entry_at(entries, n, causal, mode, d)
        if n < TARGET_MIN_N or entry is None or key not in methods.get("sdpa_cudnn", {}):
            continue
        kernel = entry.get("kernel", "triton")
        times = kernel_times(methods, kernel)
        sage_ms = times[key] if mode == "forward" else sage_rows(methods, kernel)[entry["backward"]][key]
        per_point.append({"n": n, "causal": causal, "kernel": kernel, "backend": entry["backend"],
                          **({"backward": entry["backward"]} if mode == "train" else {}),
                          "ratio": round(methods["sdpa_cudnn"][key] / sage_ms, 4)})
    what = "forward (quantization included)" if mode == "forward" else "forward+backward"
    method = (f"min over N >= {TARGET_MIN_N // 1024}K, d={d}, causal and not, of cuDNN SDPA {what} ms / Sage's, "
              f"Sage on the kernel{' and backward route' if mode == 'train' else ''} each length's {mode} "
              f"dispatch entry names (the faster Sage kernel)")
    if not per_point:
        return _target(name, None, method, f"no {mode} point with N >= {TARGET_MIN_N} at d={TARGET_HEAD_DIM} measured")
    worst = min(per_point, key=lambda p: p["ratio"])
    note = None
    if all(p["backend"] == "sdpa" for p in per_point):
        note = (f"dispatch picks SDPA at every N >= {TARGET_MIN_N}: the value is the faster Sage kernel's ratio, "
                "not a dispatched one")
    return _target(name, worst["ratio"], method, note, worst=worst, per_point=per_point)


def targets(rows: list[dict], train_step: dict | None, entries: list[dict], d: int) -> dict:
    """The four targets, exactly :data:`ATTENTION_GOALS`' names, each with ``method`` and, where needed, ``note``."""
    if d != TARGET_HEAD_DIM:
        return {name: _target(name, None, "", f"this run measured d={d}; the targets are set at d={TARGET_HEAD_DIM}")
                for name in ATTENTION_GOALS}
    points = by_point(rows)
    out = {"fwd_over_cudnn_min": _ratio_target("fwd_over_cudnn_min", points, entries, d, "forward"),
           "fwd_bwd_over_cudnn_min": _ratio_target("fwd_bwd_over_cudnn_min", points, entries, d, "train")}
    step = (train_step or {}).get("speedup_vs_cudnn", {}).get(STEP_SEQ)
    sage_row = next((r for r in (train_step or {}).get("rows", []) if r.get("variant") == "sage"), {})
    step_method = (f"Llama-3-8B training step at {STEP_SEQ} tokens (benchmarks/attention/attention_train_step.py): cuDNN SDPA "
                   f"step s / Sage step s, Sage on kernel {sage_row.get('kernel', 'triton')} with backward "
                   f"{sage_row.get('backward_route')}")
    out["train_step_over_sdpa"] = _target("train_step_over_sdpa", step, step_method,
                                          None if step else "the training step was not measured in this record")
    methods = points.get((TOPS_N, False), {})
    entry = _entry_at(entries, TOPS_N, False, "forward", d)
    tops = {k: methods[KERNEL_ROW[k]]["fwd_tops"] for k in KERNELS if "fwd_tops" in methods.get(KERNEL_ROW[k], {})}
    kernel = entry.get("kernel", "triton") if entry else None
    tops_method = (f"forward kernel alone (quantization apart), N={TOPS_N}, d={d}, non-causal, "
                   f"4*B*H*d*N^2 / time, the kernel the forward dispatch entry names ({kernel})")
    value = tops.get(kernel) if kernel else None
    out["sage_fwd_tops_n16k_d128"] = _target(
        "sage_fwd_tops_n16k_d128", value, tops_method,
        None if value is not None else f"N={TOPS_N} non-causal was not measured", unit="TOPS",
        by_kernel={k: round(v, 1) for k, v in tops.items()})
    return out


def train_step_choice(rows: list[dict], train_routes=None) -> dict:
    """The Sage kernel and backward route for the 8B training step (causal): the pair with the least summed
    forward+backward time over the causal lengths >= :data:`TARGET_MIN_N` that every pair ran at, among
    ``train_routes`` (every measured route when None)."""
    totals: dict[tuple[str, str], list[float]] = {}
    points = {key: m for key, m in by_point(rows).items() if key[1] and key[0] >= TARGET_MIN_N}
    for methods in points.values():
        for kernel in KERNELS:
            for route, row in sage_rows(methods, kernel).items():
                if "fwd_bwd_ms" in row and (train_routes is None or route in train_routes):
                    totals.setdefault((kernel, route), []).append(row["fwd_bwd_ms"])
    complete = {pair: sum(ms) for pair, ms in totals.items() if len(ms) == len(points)}
    if not complete:
        return {"kernel": "triton", "backward": "cudnn", "why": "no causal length >= 8K measured: the defaults"}
    kernel, route = min(complete, key=complete.get)
    return {"kernel": kernel, "backward": route,
            "why": f"least summed causal forward+backward ms over N >= {TARGET_MIN_N} "
                   f"({', '.join(f'{k}+{r} {v:.1f}' for (k, r), v in sorted(complete.items()))})"}


def auto_step_summary(steps: list[dict], earlier: dict | None = None) -> dict:
    """``attention_train_step.py --variants auto,sdpa`` records, one per model, as attention.json keeps them:
    ``auto_train_step[model]`` holds the rows, sdpa's step time over auto's per length (``auto_over_sdpa``)
    and the kernels auto's attention calls ran, per length (its counters without the reasons);
    ``auto_over_sdpa_min`` is the least ratio over every model and length, the check that a recipe with
    ``neutrain_sage`` (the committed table) never trains slower than plain SDPA. Records of one model (its
    lengths run apart, with different step counts) merge; ``earlier`` keeps models folded before that these
    records do not name.

    Example:
        >>> step = {"model": "default", "auto_over_sdpa": {"256": 1.01},
        ...         "rows": [{"variant": "auto", "256": {"counters": {"fallback": 8, "fallback:table": 8}}}]}
        >>> auto_step_summary([step])["auto_train_step"]["default"]["auto_kernels"]
        {'256': {'fallback': 8}}
    """
    fresh: dict[str, dict] = {}
    for step in steps:  # records of one model (lengths run apart) merge; a model folded before is replaced
        entry = fresh.setdefault(step["model"], {"auto_over_sdpa": {}, "auto_kernels": {}, "rows": []})
        entry["auto_over_sdpa"].update(step["auto_over_sdpa"])
        entry["rows"] += step["rows"]
        for row in (r for r in step["rows"] if r["variant"] == "auto"):
            entry["auto_kernels"].update({seq: {k: v for k, v in cell["counters"].items() if ":" not in k}
                                          for seq, cell in row.items()
                                          if isinstance(cell, dict) and "counters" in cell})
    for entry in fresh.values():
        entry["round_spread"], entry["losses_identical"] = _rounds_agreement(entry["rows"])
    folded = {**(earlier or {}), **fresh}
    ratios = [r for m in folded.values() for r in m["auto_over_sdpa"].values()]
    # A ratio under 1 by less than the rounds' own spread (one variant against itself) is not a slowdown.
    within = [r >= 1.0 - m.get("round_spread", {}).get(seq, 0.0)
              for m in folded.values() for seq, r in m["auto_over_sdpa"].items()]
    return {"auto_train_step": folded, "auto_over_sdpa_min": min(ratios) if ratios else None,
            "auto_never_slower_within_spread": all(within) if within else None}


def _rounds_agreement(rows: list[dict]) -> tuple[dict, dict]:
    """Per length: the largest relative spread of one variant's step time over its rounds (max / min - 1),
    and whether every row's losses (both variants, every round) are the same numbers: a deterministic
    step run by the same attention function gives the same losses; a nondeterministic backward does not."""
    spread, identical = {}, {}
    seqs = {seq for row in rows for seq, cell in row.items() if isinstance(cell, dict) and "step_s" in cell}
    for seq in sorted(seqs, key=int):
        by_variant: dict[str, list[float]] = {}
        losses = []
        for row in rows:
            cell = row.get(seq)
            if isinstance(cell, dict) and "step_s" in cell:
                by_variant.setdefault(row["variant"], []).append(cell["step_s"])
                losses.append(cell.get("losses"))
        spread[seq] = max(max(t) / min(t) - 1.0 for t in by_variant.values())
        identical[seq] = None if None in losses else all(loss == losses[0] for loss in losses)
    return spread, identical
