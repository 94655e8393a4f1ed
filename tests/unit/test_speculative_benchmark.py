"""benchmarks/decode/speculative.py: the training pieces it relies on, and its ``--quick`` CPU run end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.decode import _spec_train
from benchmarks.decode._spec_train import Batches, DraftSampler, Trainer, distill_loss, extra_sources, make_llama

ROOT = Path(__file__).resolve().parents[2]


def tiny(seed: int, hidden: int = 32):
    return make_llama(64, hidden, 1, 2, 2, 2 * hidden, torch.device("cpu"), seed)


def test_quick_preset_keeps_budgets_given_on_the_command_line():
    from benchmarks.decode.speculative import parse

    assert parse(["--quick"]).budget_s == 150 and parse(["--quick"]).big_budget_s == 60
    args = parse(["--quick", "--budget-s", "100000", "--big-budget-s", "90000"])
    assert (args.budget_s, args.big_budget_s, args.hidden) == (100000, 90000, 64)


def test_trainer_clone_continues_exactly_like_the_original():
    # The distilled draft starts from the control's state: weights, AdamW moments, step and data position.
    stream = torch.randint(0, 64, (4000,), generator=torch.Generator().manual_seed(0))
    original = Trainer(tiny(0), Batches(stream, 4, 16, 0), torch.device("cpu"), 1e-2, horizon=10, warmup=2).run(steps=3)
    twin = original.clone("twin")
    assert twin.step == 3 and twin.tokens == original.tokens
    original.run(steps=2)
    twin.run(steps=2)
    for a, b in zip(original.model.parameters(), twin.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert twin.model is not original.model


def test_extra_sources_skip_heldout_texts_duplicates_tests_and_small_files(tmp_path, monkeypatch):
    body = "x = 1\n" * 500  # 3000 bytes
    held = "y = 2\n" * 500
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "tests").mkdir()
    (tmp_path / "pkg" / "a.py").write_text(body)
    (tmp_path / "pkg" / "b.py").write_text(body)  # a vendored copy: dropped
    (tmp_path / "pkg" / "c.py").write_text(held)  # equals a held-out file: dropped
    (tmp_path / "pkg" / "tests" / "d.py").write_text("z = 3\n" * 500)
    (tmp_path / "pkg" / "e.py").write_text("w = 4\n")  # under 2 kB
    monkeypatch.setattr(_spec_train.site, "getsitepackages", lambda: [str(tmp_path)])
    monkeypatch.setattr(_spec_train.sysconfig, "get_paths", lambda: {"purelib": str(tmp_path)})
    import hashlib

    texts, info = extra_sources(1 << 20, {hashlib.md5(held.encode()).hexdigest()})
    assert texts == [body]
    assert info["files"] == 1 and info["bytes"] == len(body)
    assert extra_sources(0, set()) == ([], {"bytes": 0, "files": 0})


def test_on_policy_distillation_keeps_the_prefix_and_samples_the_tail_from_the_draft():
    target, draft = tiny(0, 48).eval(), tiny(1)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    sampler = DraftSampler(batch=2, seq=12, seed=0)
    out = sampler(draft, ids[:, :8], 4)
    assert sampler.backend == "DecodeEngine" and out.shape == (2, 12)
    assert torch.equal(out[:, :8], ids[:, :8])
    loss_fn = distill_loss(target, "tvd", on_policy_every=2, sample_len=4, batch=2, seq=12)
    losses = [loss_fn(draft, ids) for _ in range(4)]
    assert loss_fn.state == {"calls": 4, "on_policy": 2}
    assert all(torch.isfinite(x) and x.requires_grad for x in losses)
    # Off-policy calls score the corpus batch itself: the same input gives the same loss.
    torch.testing.assert_close(losses[0], losses[2])


@pytest.mark.slow
def test_quick_run_writes_every_decode_target_and_every_row(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update(NEUTRAIN_GIT_COMMIT="a" * 40, NEUTRAIN_GIT_DIRTY="1", NEUTRAIN_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    # Budgets lifted: with --quick's 150 s a loaded machine skipped the HF-assisted row (value None).
    unlimited = ["--budget-s", "100000", "--big-budget-s", "100000"]
    proc = subprocess.run([sys.executable, "benchmarks/decode/speculative.py", "--quick", *unlimited, "--out-dir", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "speculative_quick.json").read_text())
    assert list(data["targets"]) == ["ar_roofline_fraction_8b", "neuzip_lossless_over_bf16_decode",
                                     "spec_over_ar_T0", "spec_over_ar_T1", "alpha_gain_points_T1"]
    for name in ("spec_over_ar_T0", "spec_over_ar_T1", "alpha_gain_points_T1", "neuzip_lossless_over_bf16_decode"):
        assert isinstance(data["targets"][name]["value"], float), name
    for name in ("spec_over_hf_assisted_T1", "k4_block_eff_over_sd_T1"):  # still measured, beside the targets
        assert isinstance(data["results"]["ratios"][name]["value"], float), name
    res, settings = data["results"], data["settings"]
    measured = {(r["method"], r["temperature"], r["num_drafts"]) for r in res["decode"] if "tokens_per_s" in r}
    for t in (0.0, 1.0):
        assert {("engine_autoregressive", t, None), ("neutrain_sd", t, 1), ("hf_assisted", t, None)} <= measured
    assert {("neutrain_greedy_tree", 0.0, k) for k in (2, 4)} <= measured
    assert {(f"neutrain_{s}", 1.0, k) for s in ("specinfer", "spectr", "importance") for k in (2, 4)} <= measured
    for row in res["decode"]:
        if row["method"].startswith("neutrain_") and row["temperature"] == 0:
            done, total = row["greedy_tokens_equal_to_engine_ar"].split("/")
            assert done == total, row  # T = 0 speculative decoding is the target's greedy decode
    assert settings["draft_train_tokens"]["control"] == settings["draft_train_tokens"]["distilled"]
    assert {"target_heldout", "target_stdlib_train", "control_heldout"} <= set(res["loss"])
    assert res["round_split_best_T1"]["round_ms"] > 0
    assert res["engine_8b"]["targets"]["neuzip_lossless_over_bf16_decode"]["value"] > 0
