"""The launch/ configs on 2 GPUs through `accelerate launch -m neutrain`, with a fused optimizer."""

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import write_recipe
from tests.integration.test_launch import REPO, _run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("config,mode", [("multi_gpu_ddp.yaml", "replicated"), ("fsdp2.yaml", "fsdp2")])
def test_launch_config_two_gpus(tmp_path, config, mode):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    pytest.importorskip("datasets")
    recipe = write_recipe(
        tmp_path, model={"dtype": "bfloat16"},
        train={"optimizer": "adalomo", "learning_rate": 1e-3, "max_steps": 3, "save_steps": 3, "use_cpu": False,
               "micro_batch_size": 2},
        export={"format": "none"}, eval={"perplexity": False},
    )
    res = _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", REPO / "launch" / config,
                "--num_processes", "2", "-m", "neutrain", recipe], cwd=REPO)
    assert res.returncode == 0, res.stderr[-4000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["distributed_mode"] == mode
    losses = [json.loads(line)["loss"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert len(losses) == 3 and all(loss == loss for loss in losses)
    assert Path(tmp_path / "out" / "checkpoint-3").is_dir()
