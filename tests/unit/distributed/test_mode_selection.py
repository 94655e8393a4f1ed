"""One object per distributed mode: each launch and recipe gets the right one, contradictions the same one-line errors."""

from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from neutrain.config.sections import TrainSection
from neutrain.config.validate import section_from
from neutrain.cli.preflight import check_distributed
from neutrain.distributed import resume_files
from neutrain.distributed.arguments import FSDP2_DEFAULTS, distributed_request
from neutrain.distributed.modes import (
    FSDP2,
    Ordinary,
    Replicated,
    Single,
    ZeRO3,
    choose_mode,
    mode_named,
)
from neutrain.errors import RecipeError, UserInputError

TRAIN = {"distributed": "auto", "fsdp": None, "fsdp_config": None, "deepspeed": None}


def launch(kind=DistributedType.NO, processes=1, fsdp_version=2, zero3=True):
    """An ``Accelerator`` as far as mode selection reads it."""
    state = SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=fsdp_version),
                            deepspeed_plugin=SimpleNamespace(hf_ds_config=SimpleNamespace(is_zero3=lambda: zero3)))
    return SimpleNamespace(distributed_type=kind, num_processes=processes, state=state)


@pytest.mark.parametrize("accelerator,fused,expected", [
    (launch(), True, Single()),
    (launch(), False, Ordinary()),
    (launch(DistributedType.MULTI_CPU, 2), True, Replicated()),
    (launch(DistributedType.MULTI_GPU, 4), True, Replicated()),
    (launch(DistributedType.MULTI_CPU, 2), False, Ordinary()),  # the Trainer's DDP
    (launch(DistributedType.FSDP, 2), True, FSDP2(fused=True)),
    (launch(DistributedType.FSDP, 2), False, FSDP2(fused=False)),
    (launch(DistributedType.FSDP, 2, fsdp_version=1), False, Ordinary()),  # FSDP1 with the Trainer's optimizer
    (launch(DistributedType.DEEPSPEED, 2), True, ZeRO3(fused=True)),
    (launch(DistributedType.DEEPSPEED, 2), False, ZeRO3(fused=False)),
    (launch(DistributedType.DEEPSPEED, 2, zero3=False), False, Ordinary(deepspeed_client=True)),
    # a fused run under ZeRO-1/2 is still ZeRO3: its config check refuses the stage by key
    (launch(DistributedType.DEEPSPEED, 2, zero3=False), True, ZeRO3(fused=True)),
])
def test_each_launch_gets_its_mode(accelerator, fused, expected):
    mode = choose_mode(accelerator, fused)
    assert mode == expected and type(mode) is type(expected)


def test_summary_names_and_sharding_per_mode():
    names = {type(m).__name__: (m.name, m.sharded) for m in (Ordinary(), Single(), Replicated(), FSDP2(), ZeRO3())}
    assert names == {"Ordinary": (None, False), "Single": ("single", False), "Replicated": ("replicated", False),
                     "FSDP2": ("fsdp2", True), "ZeRO3": ("deepspeed", True)}
    assert FSDP2().export_note.startswith("FSDP2: merge") and ZeRO3().export_note is None


def test_fused_updates_under_fsdp1_are_refused():
    with pytest.raises(ValueError, match=r"fused updates need FSDP2 \(fsdp_version: 2\)"):
        choose_mode(launch(DistributedType.FSDP, 2, fsdp_version=1), fused=True)


@pytest.mark.parametrize("name,expected", [
    (None, ((), ("optimizer.pt", "scheduler.pt"))),
    ("single", ((), ("optimizer.pt", "scheduler.pt"))),
    ("replicated", ((), ("optimizer.pt", "scheduler.pt"))),
    ("fsdp2", (("model.rank1-of-2.safetensors",), ("optimizer.rank1-of-2.safetensors", "scheduler.pt"))),
    ("deepspeed", (("zero3_partitions.rank1-of-2.safetensors",), ("optimizer.rank1-of-2.safetensors", "scheduler.pt"))),
])
def test_resume_files_per_mode(name, expected):
    assert resume_files(name, 1, 2) == mode_named(name).resume_files(1, 2) == expected
    assert mode_named(mode_named(name)) is mode_named(name)


def _trainer(model=None, **memory):
    return SimpleNamespace(memory=section_from("memory", memory), model=model or torch.nn.Linear(2, 2),
                           accelerator=None, args=None)


@pytest.mark.parametrize("mode,message", [
    (FSDP2(fused=True), "memory.loss_chunk_size is not supported with FSDP2; set it to 0"),
    (ZeRO3(fused=True), "memory.loss_chunk_size is not supported with DeepSpeed ZeRO-3; set it to 0"),
])
def test_sharded_fused_modes_refuse_the_chunked_loss(mode, message):
    with pytest.raises(UserInputError) as err:
        mode.setup(_trainer(loss_chunk_size=1024))
    assert str(err.value) == message
    mode.setup(_trainer(loss_chunk_size=0))
    type(mode)(fused=False).setup(_trainer(loss_chunk_size=1024))  # DeepSpeed's or torch's optimizer: no fused hook


def test_zero3_refuses_compressed_weights():
    from neutrain.nn.convert import compress_model

    model = torch.nn.Sequential(torch.nn.Linear(64, 64).to(torch.bfloat16))
    compress_model(model, progress=False)
    with pytest.raises(UserInputError, match="^DeepSpeed ZeRO-3 partitions dense weights only: set memory.weights: dense$"):
        ZeRO3(fused=True).setup(_trainer(model))


def test_replicated_keeps_ddp_away():
    calls = []
    accelerator = SimpleNamespace(prepare_model=lambda model, device_placement=None, evaluation_mode=False:
                                  calls.append(evaluation_mode) or model)
    Replicated().setup(SimpleNamespace(accelerator=accelerator))
    accelerator.prepare_model(torch.nn.Linear(2, 2))
    assert calls == [True]


# ---- the recipe's train.distributed: arguments and the same one-line errors as before -----------------------


@pytest.mark.parametrize("train,arguments,key", [
    ({}, {"deepspeed": None, "fsdp": "", "fsdp_config": None}, "train.fsdp: None"),
    ({"distributed": "replicated"}, {"deepspeed": None, "fsdp": "", "fsdp_config": None}, "train.fsdp: None"),
    ({"distributed": "deepspeed", "deepspeed": "ds.json"}, {"deepspeed": "ds.json", "fsdp": "", "fsdp_config": None},
     "train.fsdp: None"),
    ({"distributed": "fsdp2"}, {"deepspeed": None, "fsdp": "full_shard auto_wrap", "fsdp_config": FSDP2_DEFAULTS},
     "train.distributed: fsdp2"),
    ({"fsdp": "full_shard"}, {"deepspeed": None, "fsdp": "full_shard", "fsdp_config": None}, "train.fsdp: 'full_shard'"),
])
def test_recipe_request_per_value(train, arguments, key):
    request = distributed_request(TrainSection.model_construct(**{**TRAIN, **train}))
    assert request.arguments == arguments and request.key == key


@pytest.mark.parametrize("train,message", [
    ({"distributed": "replicated", "fsdp": "full_shard"}, "train.distributed: replicated contradicts train.fsdp / train.deepspeed"),
    ({"distributed": "deepspeed"}, "train.distributed: deepspeed needs train.deepspeed (e.g. launch/deepspeed_zero3.json)"),
    ({"distributed": "fsdp2", "fsdp_config": {"fsdp_version": 1}}, "train.distributed: fsdp2 with fsdp_config.fsdp_version != 2"),
    ({"distributed": "fsdp2", "fsdp": "full_shard", "fsdp_config": {}, "deepspeed": "d.json"},
     "train.distributed: fsdp2 contradicts train.deepspeed"),
])
def test_contradictions_are_the_same_one_line_errors(train, message, tmp_path):
    train = TrainSection.model_construct(**{**TRAIN, **train})
    if train.deepspeed:  # preflight reads the file first
        train = train.changed(deepspeed=str(tmp_path / "d.json"))
        (tmp_path / "d.json").write_text("{}")
    with pytest.raises(UserInputError) as err:
        check_distributed(train, 2)
    assert str(err.value) == message


@pytest.mark.parametrize("train,key", [
    ({"distributed": "fsdp2"}, "train.distributed: fsdp2"),
    ({"fsdp": "full_shard auto_wrap"}, "train.fsdp: 'full_shard auto_wrap'"),
])
def test_sharding_on_one_process_names_the_key(train, key):
    with pytest.raises(RecipeError) as err:
        check_distributed(TrainSection.model_construct(**{**TRAIN, **train}), 1)
    assert str(err.value) == (f"{key} shards the model over several processes, but this launch started one; launch with "
                              "`accelerate launch --config_file launch/fsdp2.yaml -m neutrain <recipe>`, or remove the setting")
    check_distributed(TrainSection.model_construct(**{**TRAIN, **train}), 2)
