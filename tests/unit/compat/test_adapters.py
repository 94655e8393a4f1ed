"""Each private or version-sensitive touch point in neutrain.compat does what its callers rely on.

If a torch, transformers, accelerate or peft release changes one of them, the failure is here,
named after the adapter, instead of deep inside a training run.
"""

import types

import pytest
import torch

from neutrain.compat.accelerate_prepare import skip_ddp_wrapping
from neutrain.compat.autograd import in_backward
from neutrain.compat.peft_lora import register_custom_lora_module
from neutrain.compat.trainer_hooks import VERSION_DEPENDENT_KEYWORDS, checkpoint_dir_redirected, make_training_arguments


def test_in_backward_is_true_only_inside_autograd_backward():
    seen = []
    x = torch.ones(3, requires_grad=True)
    x.register_hook(lambda g: seen.append(in_backward()))
    assert not in_backward()
    (x * 2).sum().backward()
    assert seen == [True]
    assert not in_backward()


def test_in_backward_sees_a_checkpoint_recompute():
    # The prefetcher relies on this: a recompute inside backward is not a real forward.
    seen = []

    def body(x):
        seen.append(in_backward())
        return x.sin()

    x = torch.randn(4, requires_grad=True)
    torch.utils.checkpoint.checkpoint(body, x, use_reentrant=False).sum().backward()
    assert seen == [False, True]


def test_custom_lora_module_is_registered_and_used_by_peft():
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.layer import Linear as LoraLinear

    class MyLinear(torch.nn.Linear):
        pass

    class MyLoraLinear(LoraLinear):
        pass

    model = torch.nn.Sequential()
    model.add_module("proj", MyLinear(8, 8))
    config = LoraConfig(r=2, target_modules=["proj"])
    register_custom_lora_module(config, MyLinear, MyLoraLinear)
    wrapped = get_peft_model(model, config)
    assert type(wrapped.base_model.model.proj) is MyLoraLinear


def test_a_peft_without_the_registry_gets_one_clear_line():
    with pytest.raises(RuntimeError, match="_register_custom_module is missing"):
        register_custom_lora_module(types.SimpleNamespace(), torch.nn.Linear, torch.nn.Module)


def test_training_arguments_leave_out_only_version_dependent_keywords():
    class Args:  # a release that knows output_dir only
        def __init__(self, output_dir):
            self.output_dir = output_dir

    assert make_training_arguments({"output_dir": "o", **dict.fromkeys(VERSION_DEPENDENT_KEYWORDS, True)}, Args).output_dir == "o"
    with pytest.raises(TypeError, match="learning_rat"):
        make_training_arguments({"output_dir": "o", "learning_rat": 1e-3}, Args)


def test_training_arguments_of_this_transformers_accept_what_neutrain_passes(tmp_path):
    args = make_training_arguments({"output_dir": str(tmp_path), "save_safetensors": True, "use_cpu": True,
                                    "remove_unused_columns": False})
    assert args.output_dir == str(tmp_path) and args.remove_unused_columns is False


def test_checkpoint_dir_redirect_reaches_the_trainers_save_and_is_undone(tmp_path):
    from transformers import Trainer

    class Probe(Trainer):
        def __init__(self):  # no model needed: only the seam is exercised
            pass

    probe = Probe()
    with checkpoint_dir_redirected(probe, str(tmp_path)):
        assert probe._get_output_dir(trial=None) == str(tmp_path)
    assert "_get_output_dir" not in probe.__dict__  # the class method again


def test_skip_ddp_wrapping_forces_evaluation_mode_and_is_idempotent():
    calls = []

    class Accelerator:
        def prepare_model(self, model, device_placement=None, evaluation_mode=False):
            calls.append(evaluation_mode)
            return model

    acc = Accelerator()
    skip_ddp_wrapping(acc)
    skip_ddp_wrapping(acc)
    assert acc.prepare_model("m") == "m" and calls == [True]


def test_deepspeed_is_told_the_cpu_accelerator_only_without_a_gpu_and_without_a_user_setting():
    from neutrain.compat.deepspeed_env import name_cpu_accelerator

    env = {}
    name_cpu_accelerator(env, cuda_available=True)
    assert env == {}
    name_cpu_accelerator(env, cuda_available=False)
    assert env == {"DS_ACCELERATOR": "cpu"}
    mine = {"DS_ACCELERATOR": "cuda"}
    name_cpu_accelerator(mine, cuda_available=False)
    assert mine == {"DS_ACCELERATOR": "cuda"}
