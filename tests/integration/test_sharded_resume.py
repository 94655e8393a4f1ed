"""Sharded runs with an ordinary optimizer: pickle-free checkpoints that resume exactly
(FSDP2, and DeepSpeed ZeRO-3 running its own optimizer), or a clear refusal announced at the start (ZeRO-1/2).

Before: a non-fused FSDP2 run wrote Accelerate's DCP checkpoint (``pytorch_model_fsdp_0/.metadata``, ``*.distcp``),
a ZeRO-3 run DeepSpeed's (``global_step*/*_states.pt``): pickles, which the checkpoint verifier refuses, so neither
could be resumed at all, and the refusal named a file, not the reason. 2 gloo processes on CPU, as
tests/integration/test_distributed.py launches them.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from neutrain.distributed.resume import verify_resume
from neutrain.storage.manifest import MANIFEST
from neutrain.errors import CheckpointError
from tests.faults.test_checkpoint_trust import _plant
from tests.helpers import free_port, write_recipe
from tests.integration.test_launch import REPO, _run

pytestmark = pytest.mark.distributed

STEPS = {"max_steps": 4, "save_steps": 2, "logging_steps": 1, "save_total_limit": 3, "micro_batch_size": 2,
         "optimizer": "adamw", "learning_rate": 1e-2}
QUIET = {"eval": {"perplexity": False}, "export": {"format": "none"}, "memory": {"weights": "dense"}}
FSDP2 = {"distributed": "fsdp2"}
ZERO3 = {"distributed": "deepspeed", "deepspeed": str(REPO / "launch" / "deepspeed_zero3.json")}
ZERO2 = {"distributed": "deepspeed", "deepspeed": str(REPO / "launch" / "deepspeed_zero2.json")}
# DeepSpeed is optional (CPU CI may lack it): the FSDP2 test runs regardless.
NEEDS_DEEPSPEED = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")


def _train(directory: Path, engine: dict, export: str = "none", **train):
    recipe = write_recipe(directory, train={**STEPS, **engine, **train}, **{**QUIET, "export": {"format": export}})
    # Accelerate keeps FSDP for accelerator devices; the shim lets its FSDP2 path run on CPU.
    entry = "tests.unit.distributed.accelerate_cpu_fsdp" if engine is FSDP2 else "neutrain"
    return _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
                 "-m", entry, recipe])


def _losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


def _tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file (model shards or partitions, optimizer state), keyed by file:tensor."""
    return {f"{f.name}:{k}": v for f in sorted(checkpoint.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def _json_state(checkpoint: Path) -> dict[str, str]:
    """The JSON part of each rank's optimizer state (param groups, step counters, loss scaler)."""
    from safetensors import safe_open

    out = {}
    for f in sorted(checkpoint.glob("optimizer.rank*-of-2.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            out[f.name] = fh.metadata()["state"]
    return out


@pytest.mark.parametrize("engine,mode", [(FSDP2, "fsdp2"), pytest.param(ZERO3, "deepspeed", marks=NEEDS_DEEPSPEED)],
                         ids=["fsdp2", "zero3"])
def test_adamw_sharded_checkpoint_is_pickle_free_and_resumes_exactly(engine, mode, tmp_path):
    from neutrain.distributed import resume_files

    res = _train(tmp_path / "full", engine, export="hf" if mode == "deepspeed" else "none")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "neutrain will refuse to resume" not in res.stderr
    out = tmp_path / "full" / "out"
    assert json.loads((out / "summary.json").read_text())["distributed_mode"] == mode
    if mode == "deepspeed":  # the export gathers the partitioned weights (it wrote 0-element tensors, with exit 0)
        exported, saved = load_file(str(out / "export" / "model.safetensors")), load_file(str(out / "checkpoint-4" / "model.safetensors"))
        assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)
    checkpoint = out / "checkpoint-2"
    files = sorted(p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file())
    # No DCP (.metadata, .distcp) and no DeepSpeed (global_step*/*.pt, latest, zero_to_fp32.py) files.
    assert all(f.endswith((".safetensors", ".json", ".pth", ".pt", ".jinja")) and "/" not in f for f in files), files
    from neutrain.distributed.state_files import read_optimizer_state

    for rank in range(2):
        for name in (n for group in resume_files(mode, rank, 2) for n in group):
            assert name in files
        verify_resume(checkpoint, mode, rank, 2)  # every file checked: safetensors, JSON, weights-only .pt
        state, marked, meta = read_optimizer_state(str(checkpoint / f"optimizer.rank{rank}-of-2.safetensors"))
        if mode == "fsdp2":  # AdamW's moments are this rank's DTensor shards, its step counts tensors
            assert meta["optimizer"] == "AdamW" and marked and all(key in ("exp_avg", "exp_avg_sq") for _, key in marked)
            assert all(float(s["step"]) == 2.0 for s in state["state"].values())
        else:  # DeepSpeed's optimizer: fp32 master partitions, AdamW's state over them, the engine's counters
            assert meta["optimizer"] == "DeepSpeedZeroOptimizer_Stage3" and state["engine"]["global_steps"] == 2
            assert state["fp32_flat_groups"] and state["optimizer_state_dict"]["state"]

    # A pickle planted in any file of the checkpoint is refused before anything is loaded, and never runs.
    marker, copy = tmp_path / "marker", tmp_path / "planted"
    shutil.copytree(checkpoint, copy)
    for rel in files:
        if rel == MANIFEST:
            continue
        saved = {name: (copy / name).read_bytes() for name in (rel, MANIFEST)}
        _plant(copy, rel, marker)
        with pytest.raises(CheckpointError, match=re.escape(rel)):
            verify_resume(copy, mode, 1, 2)
        assert not marker.exists(), f"a pickle planted in {rel} ran"
        for name, content in saved.items():
            (copy / name).write_bytes(content)

    # Resumed from step 2 with 2 processes: the same losses, and every tensor and number of the step-4 checkpoint
    # (weights, optimizer moments, fp32 master partitions, step counters) equal to the uninterrupted run's.
    res = _train(tmp_path / "resumed", engine, resume_from_checkpoint=str(checkpoint))
    assert res.returncode == 0, res.stderr[-3000:]
    resumed = tmp_path / "resumed" / "out"
    assert len(_losses(out)) == 4 and _losses(resumed) == _losses(out)[2:]
    whole, again = _tensors(out / "checkpoint-4"), _tensors(resumed / "checkpoint-4")
    assert whole.keys() == again.keys() and any(name.startswith("optimizer.") for name in whole)
    for name in whole:
        assert torch.equal(again[name], whole[name]), name
    assert _json_state(resumed / "checkpoint-4") == _json_state(out / "checkpoint-4")


@NEEDS_DEEPSPEED
def test_zero2_with_deepspeeds_optimizer_warns_at_start_and_refuses_resume_with_the_reason(tmp_path):
    res = _train(tmp_path / "run", ZERO2, max_steps=2)
    assert res.returncode == 0, res.stderr[-3000:]
    warnings = [line for line in res.stderr.splitlines() if "neutrain will refuse to resume" in line]
    assert len(warnings) == 1, res.stderr[-3000:]  # once (the main process), when the trainer is built
    assert "is a pickle" in warnings[0] and "ZeRO-3" in warnings[0] and "fsdp2" in warnings[0]
    checkpoint = tmp_path / "run" / "out" / "checkpoint-2"
    assert any(checkpoint.glob("global_step2/*_optim_states.pt"))  # DeepSpeed's own pickles

    # Any run pointed at it (here as a single-process run would check it) is told why.
    with pytest.raises(CheckpointError, match="written by DeepSpeed's own save_checkpoint .* is a pickle.*fsdp2"):
        verify_resume(checkpoint, None, 0, 1)
    res = _train(tmp_path / "resumed", ZERO2, resume_from_checkpoint=str(checkpoint))
    assert res.returncode != 0
    errors = [line for line in res.stderr.splitlines() if line.startswith("neutrain: error: ")]
    # Rank 0 says it (every rank records its line in the launcher's error file, which prints what no rank did), and
    # no traceback follows. Once, as a rule; a rank torn down between its print and its record can leave the same
    # line said twice on a loaded machine, never another line.
    assert 1 <= len(errors) <= 2 and len(set(errors)) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    for line in errors:
        assert str(checkpoint) in line and "is a pickle, and neutrain never loads one" in line
        assert "use ZeRO-3" in line and "train.distributed: fsdp2" in line
    assert not (tmp_path / "resumed" / "out" / "checkpoint-4").exists()
