"""Draft distillation after training, speculative decoding with it, and the distill/generate commands."""

import json
import os
import subprocess
import sys
from pathlib import Path

from neutrain.cli import main
from neutrain.config import load_recipe
from neutrain.cli.train import train_from_recipe
from tests.helpers import write_recipe

REPO = Path(__file__).resolve().parents[2]


def test_default_flow_distils_a_draft_decodes_speculatively_and_a_second_distillation_needs_overwrite(tmp_path, capsys, recwarn,
                                                                                                  monkeypatch):
    recipe = load_recipe(write_recipe(
        tmp_path, train={"max_steps": 3, "save_steps": 3},
        distill={"enabled": True, "max_steps": 4, "num_drafts": 2, "draft_len": 3, "max_new_tokens": 12, "on_policy_every": 2},
    ))
    summary = train_from_recipe(recipe)
    # No warning a user cannot act on (a CPU run asked the DataLoader to pin; a memory-less plot's legend).
    noise = [str(w.message) for w in recwarn if "pin_memory" in str(w.message) or "No artists" in str(w.message)]
    assert not noise, noise
    d = summary["distill"]
    assert 0.0 < d["alpha_before"] < 1.0 and 0.0 < d["alpha"] < 1.0
    assert 1.0 <= d["block_efficiency"] <= 4.0  # at most gamma + 1 tokens per target call
    assert (Path(d["draft_dir"]) / "config.json").exists()
    draft_cfg = json.loads((Path(d["draft_dir"]) / "config.json").read_text())
    assert draft_cfg["num_hidden_layers"] == 1  # a quarter of the target's 2 layers, at least one
    out = capsys.readouterr().out
    assert "alpha" in out and "tokens per target call" in out

    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", NEUTRAIN_LOG_LEVEL="WARNING")
    res = subprocess.run([sys.executable, "-m", "neutrain", "generate", summary["export_dir"], "--draft", d["draft_dir"],
                          "--prompt", "def main(", "--max-new-tokens", "8", "--num-drafts", "2"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "tokens per target call" in res.stderr

    # `neutrain distill` on its own reads the exported target. The run distilled a draft already: a second
    # distillation is refused unless --overwrite (before: it replaced the draft silently and appended its log to
    # the first one's distill/metrics.jsonl), and then the draft and its log are those of the second one alone.
    out = Path(recipe.train.output_dir)
    kept = {p: p.read_bytes() for p in [*(out / "draft").iterdir(), out / "distill" / "metrics.jsonl"]}
    # The refusal through the CLI in this process (no interpreter start-up); the literal command runs below.
    monkeypatch.setenv("NEUTRAIN_LOG_LEVEL", "WARNING")
    capsys.readouterr()
    assert main(["distill", str(recipe.source), "distill.max_steps=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"neutrain: error: distill: '{out / 'draft'}' holds the draft of an earlier distillation")
    assert "--overwrite" in err
    assert {p: p.read_bytes() for p in kept} == kept
    res = subprocess.run([sys.executable, "-m", "neutrain", "distill", str(recipe.source), "distill.max_steps=2", "--overwrite"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "alpha" in res.stdout and "replacing the earlier distillation's draft and logs" in res.stdout
    steps = [json.loads(line)["step"] for line in (out / "distill" / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert steps == [1, 2], steps  # the second distillation's 2 steps, not appended to the first one's 4
    weights = out / "draft" / "model.safetensors"
    assert weights in kept and weights.read_bytes() != kept[weights]  # the second distillation's draft


def test_long_context_eval_runs_each_cache_compressed(tmp_path):
    from neutrain.cli.train import build_trainer, long_context_eval

    from tests.helpers import TINY_LLAMA

    # MiniCache merges layer pairs from L/2 up, so the model needs 4 layers for a merge.
    recipe = load_recipe(write_recipe(tmp_path, train={"max_steps": 1}, model={"config": {**TINY_LLAMA, "num_hidden_layers": 4}}))
    ctx = build_trainer(recipe)
    cfg = recipe.eval.changed(long_context_tasks=["niah_single"], kv_caches=["full", "minicache", "shadowkv"],
                              context_len=512, num_samples=1)
    res = long_context_eval(ctx.trainer.model, ctx.tokenizer, cfg, str(tmp_path / "eval"))
    assert set(res) == {"full", "minicache", "shadowkv"}
    assert res["minicache"]["compression_ratio"] > 1.0 and res["shadowkv"]["compression_ratio"] > 1.0
    for cache in res:
        assert (tmp_path / "eval" / f"long_context_{cache}.json").exists()
