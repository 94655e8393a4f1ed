"""Fused updates through the Trainer on 2 gloo CPU processes: replicated data parallel, FSDP2, DeepSpeed ZeRO-3.

Each mode: 1 process x micro-batch 4 and 2 processes x micro-batch 2 (same global
batch) end with the same weights within rtol 1e-5; and a 2-process run resumed
from its step-2 checkpoint ends exactly where the uninterrupted run ended.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import free_port, write_recipe
from tests.integration.test_launch import _run, _train_in_process

STEPS = {"max_steps": 4, "save_steps": 2, "logging_steps": 1, "save_total_limit": 3}
NO_EVAL = {"eval": {"perplexity": False}}

MODES = {
    # AdaLomo replicated on every process, with the chunked lm_head loss (NeuTrainer's own loss path;
    # compressed weights under data parallel: tests/unit/distributed/test_data_parallel.py).
    "replicated": {"train": {"optimizer": "adalomo", "learning_rate": 1e-2, "max_grad_norm": 1.0},
                   "memory": {"weights": "dense", "clip_mode": "global_stale", "loss_chunk_size": 64}},
    # LOMO on FSDP2 shards (dense weights), one fully_shard unit per decoder layer.
    "fsdp2": {"train": {"optimizer": "lomo", "learning_rate": 1e-2, "max_grad_norm": 1.0, "distributed": "fsdp2"},
              "memory": {"weights": "dense", "clip_mode": "per_tensor"}},
    # LOMO on ZeRO-3 flat partitions, the engine built without an optimizer (the shipped fused config).
    "deepspeed": {"train": {"optimizer": "lomo", "learning_rate": 1e-2, "max_grad_norm": 1.0, "distributed": "deepspeed",
                            "deepspeed": str(Path(__file__).resolve().parents[2] / "launch" / "deepspeed_zero3_fused.json")},
                  "memory": {"weights": "dense", "clip_mode": "per_tensor"}},
}


def _launch(directory: Path, mode: str, processes: int, export: str = "none", **train):
    spec = MODES[mode]
    train_section = {**STEPS, **spec["train"], **train}
    if processes == 1:
        train_section = {k: v for k, v in train_section.items() if k not in ("distributed", "deepspeed")}
    recipe = write_recipe(directory, train=train_section, memory=spec["memory"], export={"format": export}, **NO_EVAL)
    if processes == 1:  # the reference run, in this process
        _train_in_process(recipe)
    else:
        # Accelerate keeps FSDP for accelerator devices; the shim lets its FSDP2 path run on CPU.
        entry = "tests.unit.distributed.accelerate_cpu_fsdp" if mode == "fsdp2" else "neutrain"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
               "--master_port", str(free_port()), "-m", entry, recipe]
        res = _run(cmd)
        assert res.returncode == 0, res.stderr[-4000:]
    summary = json.loads((directory / "out" / "summary.json").read_text())
    assert summary["world_size"] == processes, "the run did not use the expected number of processes"
    assert summary["distributed_mode"] == (mode if processes > 1 else "single")
    assert summary["model_wrapper"] != "DistributedDataParallel"  # fused updates reduce gradients themselves
    return directory / "out"


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    """The step-4 checkpoint's weights: model.safetensors, or FSDP2's per-rank safetensors shards merged."""
    checkpoint = out / "checkpoint-4"
    if (checkpoint / "model.safetensors").exists():
        return load_file(str(checkpoint / "model.safetensors"))
    from neutrain.distributed.fsdp import merge_model_shards

    return merge_model_shards(str(checkpoint))


def _losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


@pytest.mark.parametrize("mode", ["replicated", "fsdp2",
                                  pytest.param("deepspeed", marks=pytest.mark.skipif(
                                           importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed"))])
def test_two_processes_match_one_and_resume_exactly(tmp_path, mode):
    one = _launch(tmp_path / "one", mode, 1, micro_batch_size=4)
    two = _launch(tmp_path / "two", mode, 2, micro_batch_size=2)
    w1, w2 = _final_weights(one), _final_weights(two)
    assert w1.keys() == w2.keys()
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-5, atol=1e-7, msg=name)
    losses = _losses(one)
    assert len(losses) == 4 and losses[-1] != losses[0]

    # Resume the 2-process run from its step-2 checkpoint, 2 processes again: exactly the same end.
    # ZeRO-3 also exports at the end: the main process writes the weights all ranks gathered.
    export = "hf" if mode == "deepspeed" else "none"
    resumed = _launch(tmp_path / "resumed", mode, 2, export=export, micro_batch_size=2,
                      resume_from_checkpoint=str(two / "checkpoint-2"))
    assert _losses(resumed) == _losses(two)[2:]
    w3 = _final_weights(resumed)
    for name in w2:
        torch.testing.assert_close(w3[name], w2[name], rtol=0, atol=0, msg=name)
    if export == "hf":
        exported = load_file(str(resumed / "export" / "model.safetensors"))
        for name in w2:
            torch.testing.assert_close(exported[name], w2[name], rtol=0, atol=0, msg=name)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_deepspeed_launch_config_runs_lomo_and_refuses_adalomo(tmp_path):
    """``accelerate launch --config_file launch/deepspeed_zero3_fused.yaml`` selects ZeRO-3 without a recipe key."""
    from tests.integration.test_launch import REPO

    def launch(directory, optimizer):
        recipe = write_recipe(directory, train={**STEPS, "max_steps": 2, "optimizer": optimizer, "learning_rate": 1e-2,
                                                "micro_batch_size": 2},
                              memory={"weights": "dense"}, export={"format": "none"}, **NO_EVAL)
        return _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                     REPO / "launch" / "deepspeed_zero3_fused.yaml", "--num_processes", "2", "--main_process_port",
                     str(free_port()), "-m", "neutrain", recipe], cwd=REPO)

    res = launch(tmp_path / "lomo", "lomo")
    assert res.returncode == 0, res.stderr[-4000:]
    summary = json.loads((tmp_path / "lomo" / "out" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["distributed_mode"] == "deepspeed"
    assert summary["model_wrapper"] == "DeepSpeedEngine"
    # AdaLomo's factored statistics need whole rows; ZeRO-3 partitions are flat slices.
    res = launch(tmp_path / "adalomo", "adalomo")
    assert res.returncode != 0
    assert "train.optimizer" in res.stderr and "ZeRO-3 partitions are flat" in res.stderr


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_deepspeed_gradient_accumulation_matches_one_process(tmp_path):
    """ZeRO-3 with 2 micro-batches per step: partition gradients are summed locally, then applied once."""
    one = _launch(tmp_path / "one", "deepspeed", 1, micro_batch_size=2, gradient_accumulation_steps=2)
    two = _launch(tmp_path / "two", "deepspeed", 2, micro_batch_size=1, gradient_accumulation_steps=2)
    assert _losses(two) == pytest.approx(_losses(one), rel=1e-5)
    w1, w2 = _final_weights(one), _final_weights(two)
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-5, atol=1e-7, msg=name)
