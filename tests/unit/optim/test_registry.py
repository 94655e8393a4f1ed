"""The optimizer registry: a new fused optimizer is one class and one registration, and every part of a run sees it.

The toy below, heavy-ball SGD updating inside backward, is registered once (the fixture) and is then named by a
recipe, built by the factory, given its hyperparameters from ``TrainingArguments`` and costed by the planner,
with nothing else changed; an unknown name is still refused in one line naming the key and the allowed values.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from neutrain.config import RecipeError, validate_recipe
from neutrain.optim import build_fused_optimizer
from neutrain.optim.clipping import as_rows
from neutrain.optim.fused import FusedOptimizer
from neutrain.optim.registry import (
    OptimizerSpec, StateCost, optimizer_spec, optimizer_specs, register_optimizer, unregister_optimizer,
)
from neutrain.optim.rule import scaled
from neutrain.memory import GIB, ModelShape, estimate, estimate_recipe
from tests.helpers import TINY_LLAMA, TINY_RECIPE

from .optim_helpers import batches, loss_fn, make_mlp

TOY = "toy-heavy-ball"
LLAMA3_8B = ModelShape(4096, 14336, 32, 32, 8, 128256, False, 128)


class HeavyBall(FusedOptimizer):
    """SGD with momentum, inside backward: ``m <- momentum * m + g``, ``w <- w - lr * m`` (one fp32 buffer)."""

    elementwise = True

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.9, weight_decay: float = 0.0, **kwargs):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay), **kwargs)

    def _begin_tensor(self, weight, state, group, ok):
        if not state:
            state["momentum_buffer"] = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)

    def _rule_chunk(self, p32, grad, coef, state, group, rows, ok, scalars):
        buffer = as_rows(state["momentum_buffer"])[rows]
        new = buffer.mul(group["momentum"]).add_(scaled(grad, coef))
        buffer.copy_(torch.where(ok, new, buffer))
        return p32.sub_(new, alpha=group["lr"])


@pytest.fixture
def heavy_ball():
    # The one registration: the momentum comes from the recipe's train.adam_beta1 (TrainingArguments.adam_beta1).
    spec = register_optimizer(OptimizerSpec(TOY, HeavyBall, elementwise=True, state=StateCost(per_element=4),
                                            arguments={"momentum": "adam_beta1"}, update_passes=5))
    yield spec
    unregister_optimizer(TOY)


def _recipe(**train):
    raw = copy.deepcopy(TINY_RECIPE)
    raw["train"].update(train)
    return raw


def test_a_recipe_names_the_registered_optimizer(heavy_ball):
    recipe = validate_recipe(_recipe(optimizer=TOY))
    assert recipe.train.optimizer == TOY
    # It is a fused optimizer to every cross-check: compressed weights need one.
    raw = _recipe(optimizer=TOY)
    raw["memory"] = {"weights": "neuzip-lossless"}
    assert validate_recipe(raw).memory.weights == "neuzip-lossless"


def test_the_factory_builds_it_and_it_updates_inside_backward(heavy_ball):
    model = make_mlp()
    before = [p.detach().clone() for p in model.parameters()]
    opt = build_fused_optimizer(model, TOY, lr=0.1, momentum=0.5)
    assert isinstance(opt, HeavyBall)
    batch = batches(1)[0]
    reference = make_mlp()
    loss_fn(reference, batch).backward()
    opt.backward(loss_fn(model, batch))
    opt.step()
    for old, new, ref in zip(before, model.parameters(), reference.parameters()):
        assert new.grad is None
        torch.testing.assert_close(new.detach(), old - 0.1 * ref.grad)  # the first step: m = g


@pytest.mark.slow  # builds a transformers Trainer
def test_the_trainer_builds_it_with_the_hyperparameters_its_spec_names(heavy_ball, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from neutrain.trainer import NeuTrainer

    assert heavy_ball.options(SimpleNamespace(adam_beta1=0.8, adam_beta2=0.999)) == {"momentum": 0.8}
    config = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}, vocab_size=64)
    args = TrainingArguments(str(tmp_path / "out"), use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                             adam_beta1=0.8)
    trainer = NeuTrainer(model=LlamaForCausalLM(config), args=args, train={"optimizer": TOY})
    opt = trainer.create_optimizer()
    assert trainer.fused and isinstance(opt, HeavyBall) and opt.param_groups[0]["momentum"] == 0.8


def test_the_planner_costs_its_state_and_update(heavy_ball):
    est = estimate(LLAMA3_8B, batch=1, seq=1024, weights="neuzip-lossless", optimizer=TOY)
    lomo = estimate(LLAMA3_8B, batch=1, seq=1024, weights="neuzip-lossless", optimizer="lomo")
    assert est.terms["optimizer_state"] == 4 * LLAMA3_8B.params()  # one fp32 buffer per weight
    assert "optimizer_state" not in lomo.terms
    # Element-wise like LOMO: the vocabulary matrix's gradient is streamed in row blocks, not held whole.
    assert est.settings["moments"]["loss"]["gradients"] == lomo.settings["moments"]["loss"]["gradients"]
    assert round((est.total - lomo.total) / GIB, 2) == round(4 * LLAMA3_8B.params() / GIB, 2)
    recipe = validate_recipe(_recipe(optimizer=TOY))
    assert estimate_recipe(recipe).terms["optimizer_state"] > 0
    from neutrain.memory.step_time import update_passes

    assert update_passes(TOY) == 5


def test_an_unknown_name_is_one_line_naming_the_key_and_every_registered_name(heavy_ball):
    with pytest.raises(RecipeError) as err:
        validate_recipe(_recipe(optimizer="toy-heavy-bal"))
    message = str(err.value)
    assert message == ("train.optimizer: 'toy-heavy-bal' is not one of adamw, sgd, lomo, adalomo, adamw-in-backward, "
                       f"{TOY}. Did you mean '{TOY}'?")
    with pytest.raises(ValueError, match=f"unknown fused optimizer 'nope'; choose one of lomo, .*{TOY}"):
        build_fused_optimizer(make_mlp(), "nope", lr=0.1)


def test_the_name_is_the_registration():
    """Without its registration the toy is an unknown name again; a taken name cannot be registered."""
    with pytest.raises(RecipeError, match=f"train.optimizer: '{TOY}' is not one of adamw, sgd, lomo, adalomo, "
                                          r"adamw-in-backward\."):
        validate_recipe(_recipe(optimizer=TOY))
    for taken in ("lomo", "adamw"):
        with pytest.raises(ValueError, match=f"optimizer '{taken}' is registered already"):
            register_optimizer(OptimizerSpec(taken, HeavyBall, elementwise=True))


def test_a_spec_that_contradicts_its_class_is_refused_at_the_first_build():
    register_optimizer(OptimizerSpec(TOY, HeavyBall, elementwise=False))
    try:
        with pytest.raises(ValueError, match=r"registered with elementwise=False, but HeavyBall.elementwise is True"):
            build_fused_optimizer(make_mlp(), TOY, lr=0.1)
    finally:
        unregister_optimizer(TOY)


def test_every_shipped_spec_agrees_with_its_class():
    assert [spec.name for spec in optimizer_specs()] == ["lomo", "adalomo", "adamw-in-backward"]
    for spec in optimizer_specs():
        assert spec.resolve().elementwise == spec.elementwise, spec.name
    # AdamW in backward keeps two fp32 moments per weight, whatever the compute dtype.
    est = estimate(LLAMA3_8B, batch=1, seq=1024, weights="dense", optimizer="adamw-in-backward", dtype_bytes=2)
    assert est.terms["optimizer_state"] == 8 * LLAMA3_8B.params()
    assert optimizer_spec("adalomo").state.bytes(0, [(3, 5)], 7) == 4 * (3 + 5 + 7)


def test_the_registry_and_the_recipe_check_import_no_torch():
    """The recipe check and the planner read the registry before torch is imported (a bad recipe is refused at once)."""
    code = ("import sys, neutrain.config.validate, neutrain.optim.registry, neutrain.eval.kv.registry, "
            "neutrain.memory.planner; from neutrain.config.schema import OPTIMIZERS, KV_CACHES; "
            "assert 'lomo' in OPTIMIZERS and 'minicache' in KV_CACHES; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
