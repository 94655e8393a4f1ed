"""Honest dispatch: SageAttention only where the benchmark measured it faster than SDPA.

``benchmarks/attention/attention.py`` times SageAttention against cuDNN SDPA on the card it runs
on and writes :data:`TABLE_PATH` (package data). Each entry covers one (device name,
head dim, causal, dtype, mode) and a closed range of sequence lengths, and names the
winner. ``mode`` is ``"forward"`` (inference, eval prefill: no gradient) or ``"train"``
(forward + backward). Sage is picked only inside a range whose measured end points
were both faster with sage; everything else (another card, an unmeasured length, a
shape the table calls slower) runs torch SDPA, with the reason logged once.

``NEUTRAIN_SAGE_DISPATCH`` overrides the table: ``always`` (sage wherever the kernel
supports the call: tests, benchmarks), ``never`` (SDPA), ``table`` (default).
``NEUTRAIN_SAGE_DISPATCH_TABLE`` points at another table file. ``NEUTRAIN_SAGE_BACKWARD`` names the
backward route under ``always`` on a GPU, and on CPU (:func:`cpu_backward`) for every Sage call.

Sage's forward runs on one of :data:`KERNELS`: ``triton`` (every CUDA GPU, the default) or
``gluon`` (the warp-specialized Hopper kernel, capability 9.x only; elsewhere the call keeps the
Triton kernel). A table entry names its kernel (``"kernel"``, ``triton`` when absent);
``NEUTRAIN_SAGE_KERNEL`` overrides it. No shipped entry names ``gluon`` until it is measured.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from neutrain.config.knobs import SAGE_KERNELS, SAGE_POLICIES, knob
from neutrain.files import read_json_object

TABLE_PATH = Path(__file__).with_name("dispatch_table.json")
POLICIES = SAGE_POLICIES
MODES = ("forward", "train")
KERNELS = SAGE_KERNELS


@dataclass(frozen=True)
class Choice:
    """What one attention call runs: ``backend`` "sage" or "sdpa", sage's ``backward`` route, why,
    and sage's forward ``kernel`` (one of :data:`KERNELS`)."""

    backend: str
    backward: str = "triton"
    reason: str = ""
    kernel: str = "triton"


def policy() -> str:
    """The ``NEUTRAIN_SAGE_DISPATCH`` policy (``table`` when unset)."""
    return knob("NEUTRAIN_SAGE_DISPATCH")


def kernel_override() -> str | None:
    """The ``NEUTRAIN_SAGE_KERNEL`` override of the forward kernel (``None`` when unset).

    Example:
        >>> kernel_override() in (None, *KERNELS)
        True
    """
    return knob("NEUTRAIN_SAGE_KERNEL")


def cpu_backward() -> str:
    """Sage's backward route for a CPU call, from ``NEUTRAIN_SAGE_BACKWARD``.

    ``triton`` (unset) is the quantized reference backward. The exact GPU routes (``cudnn``,
    ``flash``) and ``cpu`` all give ``cpu``: torch's exact CPU kernel fed the quantized forward's
    O and LSE, the same semantics as the cuDNN route the train-mode table entries name, so a
    CPU study can follow what a GPU training step would run.

    Example:
        >>> cpu_backward() in ("triton", "cpu")
        True
    """
    return "triton" if knob("NEUTRAIN_SAGE_BACKWARD") == "triton" else "cpu"


def table_path() -> Path:
    return Path(knob("NEUTRAIN_SAGE_DISPATCH_TABLE") or TABLE_PATH)


@lru_cache(maxsize=4)
def load_table(path: str) -> tuple[dict, ...]:
    """The entries of a dispatch table file (empty when the file is missing or unreadable: a FIFO is refused
    unopened)."""
    try:
        data = read_json_object(path, f"dispatch table '{path}'", ValueError)
    except ValueError:
        return ()
    entries = data.get("entries", [])
    return tuple(e for e in entries if isinstance(e, dict))


def lookup(device: str, head_dim: int, causal: bool, dtype: str, mode: str, seq_len: int,
           entries: tuple[dict, ...] | None = None) -> Choice:
    """The table's choice for one call shape; ``sdpa`` unless an entry says sage is faster.

    Example:
        >>> e = ({"device": "GPU X", "head_dim": 128, "causal": True, "dtype": "bfloat16", "mode": "train",
        ...       "seq_min": 8192, "seq_max": 16384, "backend": "sage", "backward": "cudnn"},)
        >>> lookup("GPU X", 128, True, "bfloat16", "train", 12288, e).backend
        'sage'
        >>> lookup("GPU X", 128, True, "bfloat16", "train", 4096, e).backend
        'sdpa'
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if entries is None:
        entries = load_table(str(table_path()))
    # The reason names the shape family, not N: it is logged once per distinct reason.
    shape = f"{device}, d={head_dim}, causal={causal}, {dtype}, {mode}"
    for e in entries:
        if (e.get("device") == device and e.get("head_dim") == head_dim and e.get("causal") == causal
                and e.get("dtype") == dtype and e.get("mode") == mode
                and e.get("seq_min", 0) <= seq_len <= e.get("seq_max", -1)):
            if e.get("backend") == "sage":
                return Choice("sage", e.get("backward", "triton"), f"measured faster ({shape})",
                              e.get("kernel", "triton"))
            return Choice("sdpa", reason=f"SDPA measured faster ({shape})")
    return Choice("sdpa", reason=f"no measurement in the dispatch table ({shape})")


@lru_cache(maxsize=4)
def _kernel_configs(path: str) -> dict:
    try:
        data = read_json_object(path, f"dispatch table '{path}'", ValueError)
    except ValueError:
        return {}
    configs = data.get("kernel_configs", {})
    return configs if isinstance(configs, dict) else {}


def kernel_config(device: str, head_dim: int) -> dict | None:
    """The forward kernel settings the benchmark's autotune picked for this device and head dim, if any.

    Example:
        >>> kernel_config("no such GPU", 128) is None
        True
    """
    cfg = _kernel_configs(str(table_path())).get(device, {}).get(str(head_dim))
    return dict(cfg) if isinstance(cfg, dict) else None


def choose(device: str, head_dim: int, causal: bool, dtype: str, training: bool, seq_len: int) -> Choice:
    """Apply the ``NEUTRAIN_SAGE_DISPATCH`` policy, then the table, to one supported call."""
    mode = "train" if training else "forward"
    p = policy()
    if p == "always":
        choice = Choice("sage", knob("NEUTRAIN_SAGE_BACKWARD"), "NEUTRAIN_SAGE_DISPATCH=always")
    elif p == "never":
        return Choice("sdpa", reason="NEUTRAIN_SAGE_DISPATCH=never")
    else:
        choice = lookup(device, head_dim, causal, dtype, mode, seq_len)
    kernel = kernel_override()
    if choice.backend == "sage" and kernel is not None:
        choice = replace(choice, kernel=kernel)
    return choice


def build_entries(device: str, head_dim: int, causal: bool, dtype: str, mode: str, points: list[dict],
                  margin: float = 1.02) -> list[dict]:
    """Table entries from measured points ``{"n", "sage_ms", "sdpa_ms", "backward"}`` of one shape family.

    Between two consecutive measured lengths, sage is chosen only if it was at least
    ``margin`` times faster at both; each measured length also gets its own one-point
    entry, so every length the table sends to sage was timed at or bracketed by wins.

    Example:
        >>> pts = [{"n": 8192, "sage_ms": 9.0, "sdpa_ms": 10.0, "backward": "cudnn"},
        ...        {"n": 16384, "sage_ms": 30.0, "sdpa_ms": 40.0, "backward": "cudnn"}]
        >>> sorted((e["seq_min"], e["seq_max"], e["backend"]) for e in build_entries("X", 128, True, "bfloat16", "train", pts))
        [(8192, 8192, 'sage'), (8192, 16384, 'sage'), (16384, 16384, 'sage')]
    """
    pts = sorted(points, key=lambda p: p["n"])
    base = {"device": device, "head_dim": head_dim, "causal": causal, "dtype": dtype, "mode": mode}

    def wins(p):
        return p["sdpa_ms"] / p["sage_ms"] >= margin

    def evidence(p):
        return {"n": p["n"], "sage_ms": round(p["sage_ms"], 4), "sdpa_ms": round(p["sdpa_ms"], 4),
                "speedup": round(p["sdpa_ms"] / p["sage_ms"], 4)}

    entries = []
    for i, p in enumerate(pts):
        entries.append({**base, "seq_min": p["n"], "seq_max": p["n"], "backend": "sage" if wins(p) else "sdpa",
                        "backward": p.get("backward", "triton"), "evidence": [evidence(p)]})
        if i + 1 < len(pts):
            q = pts[i + 1]
            both = wins(p) and wins(q)
            # The slower of the two end points' backward routes would be a guess: keep the one
            # measured at the shorter end (the benchmark picks one route per shape family).
            entries.append({**base, "seq_min": p["n"], "seq_max": q["n"], "backend": "sage" if both else "sdpa",
                            "backward": p.get("backward", "triton"), "evidence": [evidence(p), evidence(q)]})
    # Exact-length entries first, so a measured length is decided by its own measurement.
    return sorted(entries, key=lambda e: (e["seq_max"] - e["seq_min"], e["seq_min"]))
