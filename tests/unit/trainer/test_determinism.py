"""train.deterministic: training runs on reproducible kernels, and only training (neutrain.trainer.determinism)."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

from neutrain.config import load_recipe
from neutrain.trainer.determinism import CUBLAS_WORKSPACE, deterministic_kernels
from neutrain.trainer.trainer import NeuTrainer
from tests.helpers import write_recipe


@pytest.fixture
def clean_environment(monkeypatch):
    """No user setting of the variables the switch adds (each test states its own)."""
    for name in (CUBLAS_WORKSPACE[0], "FLASH_ATTENTION_DETERMINISTIC"):
        monkeypatch.delenv(name, raising=False)
    assert not torch.are_deterministic_algorithms_enabled()


def test_inside_the_switch_kernels_are_deterministic_and_everything_is_put_back(clean_environment):
    with deterministic_kernels(True):
        assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ[CUBLAS_WORKSPACE[0]] == CUBLAS_WORKSPACE[1]  # else PyTorch refuses cuBLAS products
        assert os.environ["FLASH_ATTENTION_DETERMINISTIC"] == "1"
    assert not torch.are_deterministic_algorithms_enabled()
    assert CUBLAS_WORKSPACE[0] not in os.environ and "FLASH_ATTENTION_DETERMINISTIC" not in os.environ
    with pytest.raises(RuntimeError, match="stopped"):
        with deterministic_kernels(True):
            raise RuntimeError("stopped")
    assert not torch.are_deterministic_algorithms_enabled() and CUBLAS_WORKSPACE[0] not in os.environ
    with deterministic_kernels(False):
        assert not torch.are_deterministic_algorithms_enabled()


def test_a_user_setting_is_kept(clean_environment, monkeypatch):
    monkeypatch.setenv(CUBLAS_WORKSPACE[0], ":16:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with deterministic_kernels(True):
            assert os.environ[CUBLAS_WORKSPACE[0]] == ":16:8"
            assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ[CUBLAS_WORKSPACE[0]] == ":16:8"
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


class _RecordsKernelMode(TrainerCallback):
    def __init__(self):
        self.seen: list[bool] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(torch.are_deterministic_algorithms_enabled())


@pytest.mark.slow
@pytest.mark.parametrize("deterministic", [True, False])
def test_neutrainer_trains_on_deterministic_kernels_when_the_recipe_says_so(tmp_path, clean_environment,
                                                                           deterministic):
    recipe = load_recipe(write_recipe(tmp_path, train={"optimizer": "lomo", "deterministic": deterministic}))
    assert recipe.train.deterministic is deterministic
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    rows = [{"input_ids": torch.arange(16) % 64, "labels": torch.arange(16) % 64}] * 4
    args = TrainingArguments(str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2, use_cpu=True,
                             report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True)
    record = _RecordsKernelMode()
    trainer = NeuTrainer(model=model, args=args, train_dataset=rows, train=recipe.train, callbacks=[record])
    trainer.train()
    assert record.seen == [deterministic, deterministic]
    assert not torch.are_deterministic_algorithms_enabled()  # evaluation and generation afterwards: as before
