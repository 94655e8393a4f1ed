"""The launch/ configs on 2 GPUs through `accelerate launch -m neutrain`, with a fused optimizer (and ZeRO-3 resume)."""

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import free_port, write_recipe
from tests.integration.test_launch import REPO, _run

pytestmark = pytest.mark.gpu


def _launch_two_gpus(directory: Path, config: str, optimizer: str, steps: int, **train) -> tuple[dict, list[float]]:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    pytest.importorskip("datasets")
    recipe = write_recipe(
        directory, model={"dtype": "bfloat16"},
        train={"optimizer": optimizer, "learning_rate": 1e-3, "max_steps": steps, "save_steps": steps, "use_cpu": False,
               "micro_batch_size": 2, **train},
        export={"format": "none"}, eval={"perplexity": False},
    )
    res = _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", REPO / "launch" / config,
                "--num_processes", "2", "--main_process_port", str(free_port()), "-m", "neutrain", recipe],
               cwd=REPO)
    assert res.returncode == 0, res.stderr[-4000:]
    summary = json.loads((directory / "out" / "summary.json").read_text())
    assert summary["world_size"] == 2
    losses = [json.loads(line)["loss"] for line in (directory / "out" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert all(loss == loss for loss in losses)
    return summary, losses


@pytest.mark.parametrize("config,mode", [("multi_gpu_ddp.yaml", "replicated"), ("fsdp2.yaml", "fsdp2")])
def test_launch_config_two_gpus(tmp_path, config, mode):
    summary, losses = _launch_two_gpus(tmp_path, config, "adalomo", 3)
    assert summary["distributed_mode"] == mode and len(losses) == 3
    assert Path(tmp_path / "out" / "checkpoint-3").is_dir()


def test_deepspeed_zero3_two_gpus_resumes(tmp_path):
    """ZeRO-3 through the Trainer (engine without an optimizer) on 2 GPUs; resume from step 2 continues the run."""
    pytest.importorskip("deepspeed")
    config = "deepspeed_zero3_fused.yaml"
    summary, losses = _launch_two_gpus(tmp_path / "full", config, "lomo", 4, save_steps=2, learning_rate=1e-2)
    assert summary["distributed_mode"] == "deepspeed" and summary["model_wrapper"] == "DeepSpeedEngine"
    assert len(losses) == 4 and losses[-1] < losses[0]
    checkpoint = tmp_path / "full" / "out" / "checkpoint-2"
    assert sorted(p.name for p in checkpoint.glob("zero3_partitions.*")) == [
        "zero3_partitions.rank0-of-2.safetensors", "zero3_partitions.rank1-of-2.safetensors"]
    _, resumed = _launch_two_gpus(tmp_path / "resumed", config, "lomo", 4, save_steps=2, learning_rate=1e-2,
                                  resume_from_checkpoint=str(checkpoint))
    # bf16 on GPU: the same kernels on the same data; a resume that lost the weights would restart from step 0.
    assert resumed == pytest.approx(losses[2:], rel=1e-3)
    from safetensors.torch import load_file

    w_full = load_file(str(tmp_path / "full" / "out" / "checkpoint-4" / "model.safetensors"))
    w_resumed = load_file(str(tmp_path / "resumed" / "out" / "checkpoint-4" / "model.safetensors"))
    for name in w_full:
        torch.testing.assert_close(w_resumed[name].float(), w_full[name].float(), rtol=1e-2, atol=1e-3, msg=name)
