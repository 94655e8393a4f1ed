"""Sage's fidelity gate on a real model's activations, for the benchmark and the tests alike.

The gate: cos >= :data:`FWD_COS` on the output and >= :data:`GRAD_COS` on each of dQ, dK, dV against fp32
attention, on one layer of SmolLM2-135M-Instruct (``tests/data/smollm2_attention_layer.safetensors``,
written by ``benchmarks/attention/smollm2_attention_fixture.py``). Random Gaussian inputs lack a real model's
outlier channels and sink tokens, and a backward route that passes on them can miss here: cuDNN's exact
backward fed Sage's O and LSE does (dQ 0.9977), the quantized Triton backward does not. The attention
benchmark measures every (kernel, route) pair on the device with :func:`route_fidelity` and lets the
dispatch table name a route for training only where every kernel passed with it.

    >>> from benchmarks.attention._attention_fidelity import route_fidelity
    >>> report = route_fidelity("cpu", ["reference"], ["triton"])  # doctest: +SKIP
    >>> report["admissible_train_routes"]  # doctest: +SKIP
    ['triton']
"""

from __future__ import annotations

from pathlib import Path

import torch

FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "data" / "smollm2_attention_layer.safetensors"
FWD_COS, GRAD_COS = 0.999, 0.998  # the fidelity gate, against fp32


def fixture(device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """(q, k, v, do) of the real layer, bf16, on ``device``."""
    from safetensors.torch import load_file

    tensors = load_file(str(FIXTURE), device=device)
    return tensors["q"], tensors["k"], tensors["v"], tensors["do"]


def against_fp32(device: str, backend: str, backward: str) -> dict:
    """Sage (forward ``backend``, backward ``route``) against fp32 attention on the fixture:
    ``{"fwd": metrics, "grads": [dq, dk, dv metrics], "fallbacks": n}`` (metrics of ``accuracy_metrics``)."""
    from neutrain.attention import counters, exact_attention, reset_counters, sage_attention
    from neutrain.attention.reference import accuracy_metrics

    q, k, v, do = fixture(device)
    qe, ke, ve = (t.float().requires_grad_() for t in (q, k, v))
    exact = exact_attention(qe, ke, ve, causal=True)
    exact.backward(do.float())
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    reset_counters()
    out = sage_attention(qg, kg, vg, causal=True, backend=backend, backward=backward)
    out.backward(do)
    return {"fwd": accuracy_metrics(out, exact),
            "grads": [accuracy_metrics(a.grad, b.grad) for a, b in ((qg, qe), (kg, ke), (vg, ve))],
            "fallbacks": counters["fallback"], "counters": dict(counters)}


def forward_passes(result: dict) -> bool:
    return result["fallbacks"] == 0 and result["fwd"]["cos"] >= FWD_COS


def gradients_pass(result: dict) -> bool:
    return result["fallbacks"] == 0 and all(g["finite"] and g["cos"] >= GRAD_COS for g in result["grads"])


def route_fidelity(device: str, kernels: list[str], routes: list[str]) -> dict:
    """Every (kernel, route) pair on the fixture: its cosines, whether it passes, and the routes every kernel
    passed with (``admissible_train_routes``, the ones a train-mode dispatch entry may name). A pair that
    raises is recorded with its error and does not pass."""
    by_route: dict[str, dict] = {}
    for route in routes:
        for kernel in kernels:
            try:
                r = against_fp32(device, kernel, route)
                by_route.setdefault(route, {})[kernel] = {
                    "fwd_cos": round(r["fwd"]["cos"], 6), "grad_cos": [round(g["cos"], 6) for g in r["grads"]],
                    "forward_passes": forward_passes(r), "passes": forward_passes(r) and gradients_pass(r),
                    "fallbacks": r["fallbacks"]}
            except Exception as exc:  # noqa: BLE001 - a failing pair is a measurement, not a crash of the sweep
                by_route.setdefault(route, {})[kernel] = {"error": f"{type(exc).__name__}: {exc}"[:300],
                                                          "forward_passes": False, "passes": False}
    admissible = [route for route in routes if all(p["passes"] for p in by_route.get(route, {}).values())]
    return {"fixture": FIXTURE.name, "gate": {"fwd_cos": FWD_COS, "grad_cos": GRAD_COS},
            "by_route": by_route, "admissible_train_routes": admissible}
