"""Mode selection, the recipe's train.distributed mapping, DDP bypass and the all-reduce queue (one process)."""

import socket

import pytest
import torch
import torch.distributed as dist

from neutrain.config.sections import TrainSection
from neutrain.errors import UserInputError
from neutrain.distributed.data_parallel import GradientAllReduce
from neutrain.distributed.arguments import FSDP2_DEFAULTS, distributed_arguments

TRAIN = {"fsdp": None, "fsdp_config": None, "deepspeed": None}


def test_fsdp2_key_fills_fsdp2_defaults_and_keeps_user_values():
    args = distributed_arguments(TrainSection.model_construct(**{**TRAIN, "distributed": "fsdp2", "fsdp_config": {"reshard_after_forward": False}}))
    assert args["fsdp"] == "full_shard auto_wrap" and args["deepspeed"] is None
    assert args["fsdp_config"] == {**FSDP2_DEFAULTS, "reshard_after_forward": False}
    assert distributed_arguments(TrainSection.model_construct(**{**TRAIN, "distributed": "auto"})) == {"deepspeed": None, "fsdp": "", "fsdp_config": None}


@pytest.mark.parametrize("train", [
    {"distributed": "replicated", "fsdp": "full_shard"},
    {"distributed": "deepspeed"},
    {"distributed": "fsdp2", "fsdp_config": {"fsdp_version": 1}},
])
def test_contradictory_distributed_keys_are_refused(train):
    with pytest.raises(UserInputError):
        distributed_arguments(TrainSection.model_construct(**{**TRAIN, **train}))


@pytest.mark.parametrize("config,named", [
    ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"}}, "'optimizer'"),
    ({"zero_optimization": {"stage": 3}, "scheduler": {"type": "WarmupLR"}}, "'scheduler'"),
    ({"zero_optimization": {"stage": 3}, "fp16": {"enabled": True}}, "fp16.enabled"),
])
def test_deepspeed_configs_fused_updates_cannot_use_are_refused_by_key(config, named):
    from neutrain.distributed.deepspeed import check_fused_config

    with pytest.raises(UserInputError, match=named.replace(".", r"\.")):
        check_fused_config(config, None, "train.deepspeed")
    check_fused_config({"zero_optimization": {"stage": 3}, "fp16": {"enabled": "auto"}}, None)  # the good one passes


def test_deepspeed_refuses_optimizers_that_need_whole_rows():
    from types import SimpleNamespace

    from neutrain.distributed.deepspeed import check_fused_config

    good = {"zero_optimization": {"stage": 3}}
    check_fused_config(good, SimpleNamespace(elementwise=True))
    with pytest.raises(UserInputError, match="train.optimizer: SimpleNamespace needs whole-row statistics"):
        check_fused_config(good, SimpleNamespace(elementwise=False))


def test_shipped_fused_deepspeed_config_passes_the_check():
    import json
    from pathlib import Path

    from neutrain.distributed.deepspeed import check_fused_config

    check_fused_config(json.loads((Path(__file__).parents[3] / "launch" / "deepspeed_zero3_fused.json").read_text()), None)


def test_single_process_accelerator_is_single():
    from accelerate import Accelerator

    from neutrain.distributed.modes import Single, choose_mode

    assert choose_mode(Accelerator(cpu=True), fused=True) == Single()


@pytest.fixture
def one_process_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_all_reduce_queue_bounds_inflight_and_drains_at_end_of_backward(one_process_group):
    sync = GradientAllReduce(max_inflight=1)
    finished = []
    layers = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(3)])
    def hook(p):
        grad, p.grad = p.grad, None
        sync.submit(grad, finished.append)

    for p in layers.parameters():
        p.register_post_accumulate_grad_hook(hook)
    layers(torch.randn(4, 3)).sum().backward()
    # 6 tensors: each submit beyond the first finishes the oldest; the end-of-backward callback finishes the last.
    assert sync.submitted == sync.completed == len(finished) == 6
    assert not sync._pending
