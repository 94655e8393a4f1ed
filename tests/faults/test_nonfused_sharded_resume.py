"""Sharded runs with an ordinary optimizer (issue 14, class 1): pickle-free checkpoints that resume exactly (FSDP2),
or a clear refusal, announced at the start of the run (DeepSpeed ZeRO-3 running its own optimizer).

Before: a non-fused FSDP2 run wrote Accelerate's DCP checkpoint (``pytorch_model_fsdp_0/.metadata``, ``*.distcp``,
pickles), which the checkpoint verifier refuses, so it could not be resumed at all; a ZeRO-3 run with DeepSpeed's
own optimizer trained without a word and its resume stopped naming one of DeepSpeed's files, not the reason.
2 gloo processes on CPU, as tests/integration/test_distributed.py launches them.
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

from neutrain.checkpoint_files import MANIFEST, verify_resume
from neutrain.config.errors import CheckpointError
from tests.faults.test_checkpoint_trust import _plant
from tests.helpers import write_recipe
from tests.integration.test_launch import REPO, _run

pytestmark = pytest.mark.distributed

STEPS = {"max_steps": 4, "save_steps": 2, "logging_steps": 1, "save_total_limit": 3, "micro_batch_size": 2,
         "optimizer": "adamw", "learning_rate": 1e-2}
QUIET = {"eval": {"perplexity": False}, "export": {"format": "none"}, "memory": {"weights": "dense"}}
FSDP2 = {"distributed": "fsdp2"}
ZERO3 = {"distributed": "deepspeed", "deepspeed": str(REPO / "launch" / "deepspeed_zero3.json")}
# DeepSpeed is optional (CPU CI may lack it): the FSDP2 test runs regardless.
NEEDS_DEEPSPEED = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")


def _train(directory: Path, engine: dict, port: int, export: str = "none", **train):
    recipe = write_recipe(directory, train={**STEPS, **engine, **train}, **{**QUIET, "export": {"format": export}})
    # Accelerate keeps FSDP for accelerator devices; the shim lets its FSDP2 path run on CPU.
    entry = "tests.unit.distributed.accelerate_cpu_fsdp" if engine is FSDP2 else "neutrain"
    return _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
                 "-m", entry, recipe])


def _losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


def _shards(checkpoint: Path, kind: str) -> dict[str, torch.Tensor]:
    return {f"{f.name}:{k}": v for f in sorted(checkpoint.glob(f"{kind}.rank*-of-2.safetensors"))
            for k, v in load_file(str(f)).items()}


def test_adamw_fsdp2_checkpoint_is_pickle_free_and_resumes_exactly(tmp_path):
    from neutrain.distributed.fsdp import merge_model_shards

    res = _train(tmp_path / "full", FSDP2, 29811)
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "full" / "out"
    assert json.loads((out / "summary.json").read_text())["distributed_mode"] == "fsdp2"
    checkpoint = out / "checkpoint-2"
    files = sorted(p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file())
    assert not [f for f in files if f.endswith((".metadata", ".distcp"))], files  # no DCP pickles
    from neutrain.distributed.state_files import read_optimizer_state

    for rank in range(2):
        assert f"model.rank{rank}-of-2.safetensors" in files and f"optimizer.rank{rank}-of-2.safetensors" in files
        verify_resume(checkpoint, "fsdp2", rank, 2)  # every file checked: safetensors, JSON, weights-only .pt
        # The ordinary optimizer's moments are this rank's DTensor shards; its step counts and groups are there too.
        state, marked, meta = read_optimizer_state(str(checkpoint / f"optimizer.rank{rank}-of-2.safetensors"))
        assert meta["optimizer"] == "AdamW" and marked and all(key in ("exp_avg", "exp_avg_sq") for _, key in marked)
        assert all(float(s["step"]) == 2.0 for s in state["state"].values())

    # A pickle planted in any file of the checkpoint is refused before anything is loaded, and never runs.
    marker, copy = tmp_path / "marker", tmp_path / "planted"
    shutil.copytree(checkpoint, copy)
    for rel in files:
        if rel == MANIFEST:
            continue
        saved = {name: (copy / name).read_bytes() for name in (rel, MANIFEST)}
        _plant(copy, rel, marker)
        with pytest.raises(CheckpointError, match=re.escape(rel.rpartition("/")[2])):
            verify_resume(copy, "fsdp2", 1, 2)
        assert not marker.exists(), f"a pickle planted in {rel} ran"
        for name, content in saved.items():
            (copy / name).write_bytes(content)

    # Resumed from step 2 with 2 processes: the same losses, weights and optimizer state as the uninterrupted run.
    res = _train(tmp_path / "resumed", FSDP2, 29812, resume_from_checkpoint=str(checkpoint))
    assert res.returncode == 0, res.stderr[-3000:]
    resumed = tmp_path / "resumed" / "out"
    assert len(_losses(out)) == 4 and _losses(resumed) == _losses(out)[2:]
    whole, again = merge_model_shards(str(out / "checkpoint-4")), merge_model_shards(str(resumed / "checkpoint-4"))
    assert whole.keys() == again.keys()
    for name in whole:
        assert torch.equal(again[name], whole[name]), name
    moments, moments_again = _shards(out / "checkpoint-4", "optimizer"), _shards(resumed / "checkpoint-4", "optimizer")
    assert moments.keys() == moments_again.keys() and moments
    for name in moments:
        assert torch.equal(moments_again[name], moments[name]), name


@NEEDS_DEEPSPEED
def test_zero3_with_deepspeeds_optimizer_warns_at_start_and_refuses_resume_with_the_reason(tmp_path):
    res = _train(tmp_path / "run", ZERO3, 29821, export="hf", max_steps=2)
    assert res.returncode == 0, res.stderr[-3000:]
    # The weights are partitioned (the run is "deepspeed"): the export gathers them, as in the checkpoint.
    out = tmp_path / "run" / "out"
    assert json.loads((out / "summary.json").read_text())["distributed_mode"] == "deepspeed"
    exported, saved = load_file(str(out / "export" / "model.safetensors")), load_file(str(out / "checkpoint-2" / "model.safetensors"))
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)
    warnings = [line for line in res.stderr.splitlines() if "neutrain will refuse to resume" in line]
    assert len(warnings) == 1, res.stderr[-3000:]  # once (the main process), when the trainer is built
    assert "is a pickle" in warnings[0] and "fused optimizer" in warnings[0] and "fsdp2" in warnings[0]
    checkpoint = out / "checkpoint-2"
    assert any(checkpoint.glob("global_step2/*_optim_states.pt"))  # DeepSpeed's own pickles

    # Any run pointed at it (here as a single-process or fused run would check it) is told why.
    with pytest.raises(CheckpointError, match="DeepSpeed's own optimizer state .* is a pickle.*train.distributed: fsdp2"):
        verify_resume(checkpoint, None, 0, 1)
    res = _train(tmp_path / "resumed", ZERO3, 29822, resume_from_checkpoint=str(checkpoint))
    assert res.returncode != 0
    errors = [line for line in res.stderr.splitlines() if line.startswith("neutrain: error: ")]
    assert len(errors) == 2, res.stderr[-3000:]  # one line per rank; torchrun adds its own failure report
    for line in errors:
        assert str(checkpoint) in line and "is a pickle, and neutrain never loads one" in line
        assert "use train.distributed: fsdp2 (any optimizer), or ZeRO-3 with a fused optimizer" in line
    assert not (tmp_path / "resumed" / "out" / "checkpoint-4").exists()
