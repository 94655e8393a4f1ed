"""Honest dispatch: the table picks sage only where measured faster; the policy overrides; the
shipped table's every sage pick carries the benchmark's evidence; the exact-backward adapter."""

import json

import pytest
import torch

from neutrain import compat
from neutrain.attention import dispatch
from neutrain.attention.reference import accuracy_metrics, exact_attention, make_attention_inputs
from neutrain.attention.sage import sage_attention

DEV = "NVIDIA H100 80GB HBM3"


def _points(speedups, backward="cudnn"):
    return [{"n": n, "sage_ms": 10.0, "sdpa_ms": 10.0 * s, "backward": backward} for n, s in speedups]


def test_build_entries_picks_sage_only_between_wins():
    pts = _points([(8192, 0.9), (16384, 1.1), (32768, 1.2)])
    entries = dispatch.build_entries(DEV, 128, True, "bfloat16", "train", pts)

    def pick(n):
        return dispatch.lookup(DEV, 128, True, "bfloat16", "train", n, tuple(entries))

    assert pick(8192).backend == "sdpa"       # measured slower
    assert pick(12288).backend == "sdpa"      # between a loss and a win: not proven
    assert pick(16384).backend == "sage" and pick(16384).backward == "cudnn"
    assert pick(24576).backend == "sage"      # bracketed by two wins
    assert pick(65536).backend == "sdpa"      # beyond the measured range
    for e in entries:
        if e["backend"] == "sage":
            assert all(ev["speedup"] >= 1.02 for ev in e["evidence"])


def test_margin_keeps_ties_on_sdpa():
    entries = tuple(dispatch.build_entries(DEV, 128, False, "bfloat16", "forward", _points([(8192, 1.01)])))
    assert dispatch.lookup(DEV, 128, False, "bfloat16", "forward", 8192, entries).backend == "sdpa"


@pytest.mark.parametrize("field,value", [("device", "NVIDIA A100"), ("head_dim", 64), ("causal", False),
                                         ("dtype", "float16"), ("mode", "forward")])
def test_lookup_needs_every_key_to_match(field, value):
    entries = tuple(dispatch.build_entries(DEV, 128, True, "bfloat16", "train", _points([(8192, 1.5)])))
    key = {"device": DEV, "head_dim": 128, "causal": True, "dtype": "bfloat16", "mode": "train", "seq_len": 8192}
    assert dispatch.lookup(**key, entries=entries).backend == "sage"
    key[field] = value
    choice = dispatch.lookup(**key, entries=entries)
    assert choice.backend == "sdpa" and "no measurement" in choice.reason


def test_policy_env_and_table_file(tmp_path, monkeypatch):
    table = tmp_path / "t.json"
    entries = dispatch.build_entries(DEV, 128, True, "bfloat16", "train", _points([(4096, 1.3)], "flash"))
    table.write_text(json.dumps({"entries": entries, "kernel_configs": {DEV: {"128": {"block_m": 128}}}}))
    monkeypatch.setenv("NEUTRAIN_SAGE_DISPATCH_TABLE", str(table))
    assert dispatch.choose(DEV, 128, True, "bfloat16", True, 4096) == dispatch.Choice(
        "sage", "flash", dispatch.choose(DEV, 128, True, "bfloat16", True, 4096).reason)
    assert dispatch.choose(DEV, 128, True, "bfloat16", False, 4096).backend == "sdpa"  # forward not measured
    assert dispatch.kernel_config(DEV, 128) == {"block_m": 128} and dispatch.kernel_config(DEV, 64) is None
    monkeypatch.setenv("NEUTRAIN_SAGE_DISPATCH", "never")
    assert dispatch.choose(DEV, 128, True, "bfloat16", True, 4096).backend == "sdpa"
    monkeypatch.setenv("NEUTRAIN_SAGE_DISPATCH", "always")
    assert dispatch.choose("any", 64, False, "bfloat16", False, 10).backend == "sage"
    monkeypatch.setenv("NEUTRAIN_SAGE_DISPATCH", "fastest")
    with pytest.raises(ValueError, match="NEUTRAIN_SAGE_DISPATCH"):
        dispatch.choose(DEV, 128, True, "bfloat16", True, 4096)


def test_forward_kernel_from_table_entry_and_override(tmp_path, monkeypatch):
    """A table entry names sage's forward kernel (``triton`` when absent); NEUTRAIN_SAGE_KERNEL overrides it."""
    entries = dispatch.build_entries(DEV, 128, True, "bfloat16", "forward", _points([(8192, 1.5)]))
    table = tmp_path / "t.json"
    monkeypatch.setenv("NEUTRAIN_SAGE_DISPATCH_TABLE", str(table))
    monkeypatch.delenv("NEUTRAIN_SAGE_KERNEL", raising=False)
    table.write_text(json.dumps({"entries": entries}))
    assert dispatch.choose(DEV, 128, True, "bfloat16", False, 8192).kernel == "triton"
    dispatch.load_table.cache_clear()
    table.write_text(json.dumps({"entries": [dict(e, kernel="gluon") for e in entries]}))
    assert dispatch.choose(DEV, 128, True, "bfloat16", False, 8192).kernel == "gluon"
    monkeypatch.setenv("NEUTRAIN_SAGE_KERNEL", "triton")
    assert dispatch.choose(DEV, 128, True, "bfloat16", False, 8192).kernel == "triton"
    monkeypatch.setenv("NEUTRAIN_SAGE_DISPATCH", "always")
    monkeypatch.setenv("NEUTRAIN_SAGE_KERNEL", "gluon")
    assert dispatch.choose("any", 64, False, "bfloat16", True, 10).kernel == "gluon"
    monkeypatch.setenv("NEUTRAIN_SAGE_DISPATCH", "never")
    assert dispatch.choose(DEV, 128, True, "bfloat16", False, 8192) == dispatch.Choice(
        "sdpa", reason="NEUTRAIN_SAGE_DISPATCH=never")
    monkeypatch.setenv("NEUTRAIN_SAGE_KERNEL", "cuda")
    monkeypatch.setenv("NEUTRAIN_SAGE_DISPATCH", "always")
    with pytest.raises(ValueError, match="NEUTRAIN_SAGE_KERNEL"):
        dispatch.choose(DEV, 128, True, "bfloat16", False, 8192)


def test_shipped_table_names_no_unmeasured_kernel():
    """The Gluon kernel is not a default route until the benchmark measures it: no shipped entry
    names a kernel other than ``triton`` without its evidence."""
    for e in dispatch.load_table(str(dispatch.TABLE_PATH)):
        assert e.get("kernel", "triton") in dispatch.KERNELS
        if e.get("kernel", "triton") != "triton":
            assert e.get("evidence"), e


def test_a_broken_table_means_sdpa_and_a_missing_one_is_named(tmp_path, monkeypatch):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    monkeypatch.setenv("NEUTRAIN_SAGE_DISPATCH_TABLE", str(bad))
    assert dispatch.choose(DEV, 128, True, "bfloat16", True, 8192).backend == "sdpa"
    # A table named but absent is a typo in the variable, not a choice of SDPA (neutrain.config.knobs).
    monkeypatch.setenv("NEUTRAIN_SAGE_DISPATCH_TABLE", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="NEUTRAIN_SAGE_DISPATCH_TABLE=.*missing.json.*no such file"):
        dispatch.choose(DEV, 128, True, "bfloat16", True, 8192)


def test_shipped_table_picks_sage_only_with_measured_wins():
    """The gate: every entry of the committed table that sends calls to sage was measured faster."""
    data = json.loads(dispatch.TABLE_PATH.read_text())
    margin = data.get("margin", 1.0)
    for e in data["entries"]:
        assert {"device", "head_dim", "causal", "dtype", "mode", "seq_min", "seq_max", "backend"} <= set(e)
        assert e["mode"] in dispatch.MODES and e["seq_min"] <= e["seq_max"]
        if e["backend"] == "sage":
            ns = {ev["n"] for ev in e["evidence"]}
            assert ns == {e["seq_min"], e["seq_max"]}, e  # both ends of the range were timed
            assert all(ev["speedup"] >= margin and ev["sdpa_ms"] > ev["sage_ms"] for ev in e["evidence"]), e


@pytest.mark.parametrize("causal", [False, True])
def test_exact_backward_route_matches_autograd_on_cpu(causal):
    """compat.sdpa_backward (CPU kernel) with the true LSE reproduces SDPA's autograd gradients."""
    q, k, v = (torch.randn(2, 3, 40, 16, requires_grad=True) for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3)
    grad = torch.randn_like(out)
    out.backward(grad)
    s = (q @ k.transpose(-1, -2)).detach() * 0.3
    if causal:
        s = s.masked_fill(~torch.ones(40, 40, dtype=torch.bool).tril(), float("-inf"))
    got = compat.sdpa_backward("cpu", grad, q.detach(), k.detach(), v.detach(), out.detach(), torch.logsumexp(s, -1),
                               causal, 0.3)
    for a, b in zip(got, (q, k, v)):
        torch.testing.assert_close(a, b.grad, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="unknown SDPA backward route"):
        compat.sdpa_backward("tpu", grad, q, k, v, out, s[..., 0], causal, 0.3)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["random", "k_offset"])
def test_sage_forward_with_exact_backward_meets_gradient_gate(kind):
    """Quantized forward's O and (smoothed-K) LSE handed to the exact CPU backward, GQA included.

    ``k_offset`` is the case that needs the smoothed K: with raw K, dQ's rowsum(dS)*k_mean term
    turned the forward's small O/LSE mismatch into dQ cos ~0.98."""
    q, k, v = make_attention_inputs(1, 4, 2, 300, 64, kind, torch.float32)
    grad = torch.randn(1, 4, 300, 64)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    sage_attention(qs, ks, vs, causal=True, backend="reference", backward="cpu").backward(grad)
    qe, ke, ve = (t.clone().requires_grad_() for t in (q, k, v))
    exact_attention(qe, ke, ve, True).backward(grad)
    cos = [accuracy_metrics(a.grad, b.grad)["cos"] for a, b in ((qs, qe), (ks, ke), (vs, ve))]
    assert min(cos) >= 0.9995, cos
