"""End to end on CPU: train, checkpoint, SIGKILL mid-run, resume exactly, export, from_pretrained."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from neutrain.trainer.callbacks import read_metrics
from neutrain.config import load_recipe
from tests.helpers import write_recipe

REPO = Path(__file__).resolve().parents[2]


def _env():
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               DISABLE_TQDM="1", PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), NEUTRAIN_LOG_LEVEL="WARNING")
    return env


def _neutrain(*args, **kw):
    return subprocess.run([sys.executable, "-m", "neutrain", *map(str, args)], env=_env(), capture_output=True, text=True, timeout=600, **kw)


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


def test_train_checkpoint_export_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    from neutrain.cli.train import build_trainer

    recipe_path = write_recipe(tmp_path, export={"max_shard_size": "40KB"}, train={"report_to": "tensorboard"})
    recipe = load_recipe(recipe_path)
    ctx = build_trainer(recipe)
    ctx.trainer.train()
    out = Path(recipe.train.output_dir)
    assert (out / "checkpoint-2").is_dir() and (out / "checkpoint-4").is_dir()
    assert not list(out.glob(".tmp-*")), "temporary checkpoint directories left behind"
    assert (out / "training_curves.png").stat().st_size > 1000
    logged = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert all({"learning_rate", "tokens_per_second", "peak_rss_gib"} <= set(r) for r in logged)
    _assert_tensorboard_has(out, "train/tokens_per_second")

    # `neutrain eval` on the recipe evaluates the last checkpoint's held-out perplexity.
    res = _neutrain("eval", recipe_path)
    assert res.returncode == 0, res.stderr
    ev = json.loads((out / "eval" / "eval_results.json").read_text())
    assert ev["checkpoint"].endswith("checkpoint-4") and 1.0 < ev["heldout_perplexity"] < 1000.0

    # Export through the CLI from the final checkpoint, sharded, and load with plain transformers.
    export_dir = tmp_path / "export"
    res = _neutrain("export", out / "checkpoint-4", "--format", "hf", "--output", export_dir, "--max-shard-size", "40KB")
    assert res.returncode == 0, res.stderr
    names = {p.name for p in export_dir.iterdir()}
    assert {"config.json", "generation_config.json", "README.md", "model.safetensors.index.json", "tokenizer.json"} <= names
    assert len([n for n in names if n.endswith(".safetensors")]) > 1, "expected a sharded export"
    loaded = AutoModelForCausalLM.from_pretrained(str(export_dir))
    trained = ctx.trainer.model.eval()
    ids = torch.randint(0, trained.config.vocab_size, (2, 17))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, trained(ids).logits)


def _assert_tensorboard_has(out: Path, tag: str) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list(out.rglob("events.out.tfevents.*"))
    assert events, "report_to=tensorboard wrote no event file"
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    assert tag in acc.Tags()["scalars"], acc.Tags()["scalars"]


def test_sigkill_mid_run_then_resume_is_bit_identical(tmp_path):
    steps = {"max_steps": 10, "save_steps": 3, "logging_steps": 1}
    (tmp_path / "ref").mkdir()
    ref = write_recipe(tmp_path / "ref", train={**steps}, export={"format": "none"}, eval={"perplexity": False})
    res = _neutrain(ref)
    assert res.returncode == 0, res.stderr
    reference = _losses(tmp_path / "ref" / "out")
    assert sorted(reference) == list(range(1, 11))

    (tmp_path / "run").mkdir()
    run = write_recipe(tmp_path / "run", train={**steps}, export={"format": "none"}, eval={"perplexity": False})
    out = tmp_path / "run" / "out"
    proc = subprocess.Popen([sys.executable, "-m", "neutrain", str(run)], env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while not (out / "checkpoint-3").is_dir():
        assert proc.poll() is None, f"training ended before it could be killed: {proc.stderr.read()[-2000:]}"
        assert time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "checkpoint-10").exists(), "the run finished before the kill"
    killed_at = max(_losses(out))
    assert killed_at < 10

    res = _neutrain(run, "train.resume_from_checkpoint=true")
    assert res.returncode == 0, res.stderr
    resumed = _losses(out)
    assert sorted(resumed) == list(range(1, 11))
    assert resumed == reference, f"losses differ after resume (killed after step {killed_at})"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 10
