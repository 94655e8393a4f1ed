"""The Accelerate configs in launch/ parse with Accelerate's own loader, and the DeepSpeed JSONs are valid."""

import json
from pathlib import Path

import pytest

LAUNCH = Path(__file__).resolve().parents[2] / "launch"


@pytest.mark.parametrize("name", ["single_gpu", "multi_gpu_ddp", "fsdp2", "deepspeed_zero2", "deepspeed_zero3",
                                  "deepspeed_zero3_fused"])
def test_accelerate_config_loads(name):
    from accelerate.commands.config.config_args import ClusterConfig

    cfg = ClusterConfig.from_yaml_file(str(LAUNCH / f"{name}.yaml"))  # raises on unknown keys
    assert cfg.distributed_type is not None
    if name.startswith("deepspeed"):
        ds_file = Path(cfg.deepspeed_config["deepspeed_config_file"])
        stage = json.loads((LAUNCH.parent / ds_file).read_text())["zero_optimization"]["stage"]
        assert stage == int(name.split("_")[1][-1])
    if name == "fsdp2":
        assert cfg.fsdp_config["fsdp_version"] == 2


def test_documented():
    text = (LAUNCH / "README.md").read_text()
    for f in LAUNCH.glob("*.yaml"):
        assert f.name in text, f"{f.name} is not documented in launch/README.md"
