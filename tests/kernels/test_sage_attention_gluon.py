"""The Gluon (warp-specialized Hopper) SageAttention forward: its machine code for sm_90 (offline,
with Triton 3.6), and on an H100 against the quantized reference, exact fp32 attention and the LSE."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from neutrain.attention import counters, exact_attention, reset_counters, sage_attention
from neutrain.attention.quant import LN2, TILE, natural_lse, quantize_attention_inputs
from neutrain.attention.reference import accuracy_metrics, make_attention_inputs, sage_reference_forward
from tests.helpers import triton36_env

ROOT = Path(__file__).resolve().parents[2]
ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9

# One compile per variant; printed as a JSON line by the child process.
_COMPILE_SCRIPT = """
import json, sys
from neutrain.kernels.sage_attention_gluon import GluonConfig, compile_for_sm90, sass_summary
out = []
for nc, pingpong, d, causal in json.loads(sys.argv[1]):
    k = compile_for_sm90(d, causal, GluonConfig(num_consumers=nc, pingpong=pingpong))
    s = sass_summary(k)
    out.append({"nc": nc, "pingpong": pingpong, "d": d, "causal": causal, "registers": s["registers"],
                "spills": s["spills"],
                "shared": k.metadata.shared, "opcodes": s["opcodes"]})
print("RESULT " + json.dumps(out))
"""
VARIANTS = [(1, False, 128, False), (2, False, 128, True), (2, False, 64, False), (2, True, 128, True)]


def test_gluon_forward_compiles_for_sm90_with_wgmma():
    """Offline compile for an H100 (no GPU needed): INT8 and FP8 warpgroup MMAs, the register
    hand-over between partitions (setmaxnreg), no spills, the shared-memory ring within 227 KB."""
    env, reason = triton36_env()
    if reason:
        pytest.skip(reason)
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(VARIANTS)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # a fresh process: its own Triton
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.split("RESULT ", 1)[1])
    for r in results:
        ops = r["opcodes"]
        shown = {k: ops.get(k, 0) for k in ("IGMMA", "QGMMA", "HGMMA", "MUFU", "USETMAXREG", "UTMALDG", "SYNCS")}
        print(r["nc"], r["pingpong"], r["d"], r["causal"], "regs", r["registers"], "spills", r["spills"],
              "shared", r["shared"], shown)
        # QK: d/32 IGMMA m64n128k32 per tile; PV: 4 QGMMA m64nDk32 per tile, twice with the V
        # residual; each in the unmasked and the masked loop of every consumer warpgroup (ping-pong:
        # plus the first tile's Q.K^T before the loops).
        assert ops.get("IGMMA", 0) == (3 if r["pingpong"] else 2) * r["nc"] * r["d"] // 32
        assert ops.get("QGMMA", 0) == 2 * r["nc"] * 2 * TILE // 32
        assert ops.get("USETMAXREG", 0) > 0 and ops.get("UTMALDG", 0) >= 4  # warp-specialized, TMA-fed
        assert r["spills"] == 0
        assert r["shared"] <= 227 * 1024


def _inputs(b, hq, hk, n, d, kind="random", k_group=TILE, v_residual=True):
    q, k, v = make_attention_inputs(b, hq, hk, n, d, kind, torch.bfloat16, "cuda")
    return q, k, v, quantize_attention_inputs(q, k, v, d ** -0.5, k_group=k_group, v_residual=v_residual)


# GluonConfig: consumers, stages, ping-pong; c2s3pp is the default (GluonConfig()).
CONFIGS = {"c1": (1, 2, False), "c2": (2, 2, False), "c2pp": (2, 2, True), "c2s3pp": (2, 3, True)}
CASES = [  # b, hq, hk, n, d, causal, config, k_group, v_residual
    (2, 4, 4, 1000, 128, False, "c2", TILE, True),
    (2, 4, 4, 1000, 128, True, "c2", TILE, True),
    (2, 4, 4, 1000, 128, True, "c2pp", TILE, True),
    (1, 8, 2, 777, 64, False, "c2pp", 16, True),    # GQA 4:1, ragged N, per-16-token K scale
    (1, 8, 2, 777, 64, False, "c1", 16, True),      # one consumer
    (1, 4, 1, 300, 128, True, "c1", TILE, False),   # GQA 4:1, plain SA2 (no V residual)
    (1, 4, 1, 300, 128, True, "c2pp", TILE, False),
    (2, 2, 2, 64, 128, True, "c2", 16, True),       # shorter than one query block
    (2, 4, 4, 1000, 128, False, "c2s3pp", TILE, False),
    (2, 4, 2, 1000, 128, True, "c2s3pp", TILE, False),
    (1, 8, 2, 777, 64, True, "c2s3pp", 16, False),
    (2, 2, 2, 64, 64, False, "c2s3pp", TILE, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hk,n,d,causal,config,k_group,v_residual", CASES)
def test_gluon_forward_matches_quantized_reference(b, hq, hk, n, d, causal, config, k_group, v_residual):
    """Same quantized inputs, same math: the torch reference's O and log2-domain LSE."""
    if not ON_HOPPER:
        pytest.skip("the Gluon kernel needs a Hopper GPU (capability 9.x)")
    from neutrain.kernels.sage_attention_gluon import GluonConfig, sage_attention_forward_gluon

    _, _, _, qi = _inputs(b, hq, hk, n, d, k_group=k_group, v_residual=v_residual)
    out, lse = sage_attention_forward_gluon(qi, causal, config=GluonConfig(*CONFIGS[config]))
    ref_out, ref_lse = sage_reference_forward(qi, causal)
    m = accuracy_metrics(out, ref_out)
    print(b, hq, hk, n, d, causal, config, k_group, v_residual, m)
    assert m["finite"] and m["cos"] >= 0.9999
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse[..., :n], ref_lse[..., :n], atol=1e-4, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal,hk,config", [(64, False, 8, "c2"), (64, True, 2, "c2pp"), (128, False, 2, "c2pp"),
                                               (128, True, 8, "c2"), (128, True, 2, "c1"),
                                               (64, True, 2, "c2s3pp"), (128, False, 8, "c2s3pp")])
def test_gluon_forward_against_exact_fp32(d, causal, hk, config, record_property):
    """The fidelity gate on fresh random inputs (ragged N = 1000): cos >= 0.999 and rel-L1 <= 0.03
    against fp32 attention; the natural LSE against fp32 logsumexp of the smoothed scores, within
    each row's worst score error from quantization (the bound of a log-sum-exp's change)."""
    if not ON_HOPPER:
        pytest.skip("the Gluon kernel needs a Hopper GPU (capability 9.x)")
    from neutrain.kernels.sage_attention_gluon import GluonConfig, sage_attention_forward_gluon

    n = 1000
    q, k, v, qi = _inputs(2, 8, hk, n, d)
    out, lse2 = sage_attention_forward_gluon(qi, causal, config=GluonConfig(*CONFIGS[config]))
    exact = exact_attention(q.float(), k.float(), v.float(), causal)
    fwd = accuracy_metrics(out, exact)
    groups = 8 // hk
    ks = (k.float() - qi.k_mean).repeat_interleave(groups, 1)
    scores = (q.float() @ ks.transpose(-1, -2)) * d ** -0.5  # exact smoothed scores, natural units
    # The same scores from the quantized Q and K (the kernel's integer dot and scales).
    k_int, k_scale = (t.repeat_interleave(groups, 1) for t in (qi.k_int, qi.k_scale))
    quantized = (qi.q_int.float() @ k_int.float().transpose(-1, -2)) * qi.q_scale[..., None] * k_scale[..., None, :]
    score_err = (quantized[..., :n, :n] * LN2 - scores).abs()
    if causal:
        allowed = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
        score_err = score_err.masked_fill(~allowed, 0.0)
    lse_err = (natural_lse(qi, lse2) - torch.logsumexp(scores, -1)).abs()
    # A log-sum-exp moves by at most the largest change of its arguments: the row's worst score
    # error from quantization bounds the LSE's (plus the kernel's exp2/fp32 rounding).
    excess = (lse_err - score_err.amax(-1)).max().item()
    record_property("fwd", fwd)
    record_property("lse_err", {"max": lse_err.max().item(), "mean": lse_err.mean().item(), "excess": excess})
    print(d, causal, hk, config, "fwd", fwd, "lse err max", lse_err.max().item(), "mean", lse_err.mean().item(),
          "excess over the score-error bound", excess)
    assert fwd["cos"] >= 0.999 and fwd["rel_l1"] <= 0.03
    assert excess <= 1e-3 and lse_err.mean().item() <= 5e-3


@pytest.mark.gpu
def test_gluon_backend_runs_forward_and_backward():
    """``backend="gluon"`` launches the Gluon forward on Hopper (counted) and trains through the
    same backward as the Triton kernel; its output and gradients match ``backend="triton"``."""
    if not ON_HOPPER:
        pytest.skip("the Gluon kernel needs a Hopper GPU (capability 9.x)")
    q, k, v = make_attention_inputs(1, 8, 2, 640, 128, "random", torch.bfloat16, "cuda")
    grad = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    results = {}
    for backend in ("gluon", "triton"):
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        reset_counters()
        out = sage_attention(qg, kg, vg, causal=True, backend=backend, backward="cudnn")
        out.backward(grad)
        assert counters["kernel"] == 1 and counters["kernel_gluon"] == (backend == "gluon")
        results[backend] = (out.detach(), qg.grad, kg.grad, vg.grad)
    for a, b in zip(results["gluon"], results["triton"]):
        assert accuracy_metrics(a, b)["cos"] >= 0.9999


@pytest.mark.gpu
@pytest.mark.parametrize("config", list(CONFIGS))
def test_gluon_forward_sass_on_device(config):
    """The kernel the device compiled (not the offline one) has the INT8 and FP8 warpgroup MMAs."""
    if not ON_HOPPER:
        pytest.skip("the Gluon kernel needs a Hopper GPU (capability 9.x)")
    from neutrain.kernels import sage_attention_gluon as g

    _, _, _, qi = _inputs(1, 2, 2, 512, 128)
    g.sage_attention_forward_gluon(qi, False, config=g.GluonConfig(*CONFIGS[config]))
    s = g.sass_summary(g._LAST_LAUNCH["forward"])
    print(config, "regs", s["registers"], "spills", s["spills"],
          {k: s["opcodes"].get(k, 0) for k in ("IGMMA", "QGMMA", "USETMAXREG", "MUFU")})
    assert s["opcodes"].get("IGMMA", 0) > 0 and s["opcodes"].get("QGMMA", 0) > 0 and s["spills"] == 0


def test_gluon_backend_elsewhere_runs_the_triton_kernel():
    """Off Hopper (here: CPU, through the interpreter) ``backend="gluon"`` is the Triton kernel."""
    if ON_HOPPER:
        pytest.skip("on Hopper the Gluon kernel runs: see the GPU tests")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = make_attention_inputs(1, 2, 1, 100, 64, "random", torch.bfloat16, device)
    outs = {}
    for backend in ("gluon", "triton"):
        reset_counters()
        outs[backend] = sage_attention(q, k, v, causal=True, backend=backend)
        assert counters["kernel"] == 1 and counters["kernel_gluon"] == 0
    assert torch.equal(outs["gluon"], outs["triton"])

