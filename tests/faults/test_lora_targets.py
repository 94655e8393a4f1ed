"""``memory.lora_target_modules`` is checked against the model's linear layers before peft wraps anything.

Before: a name that matched no layer ended in peft's ``NoMatchingPeftModuleError`` traceback (exit 1), an empty
list in another, and a misspelt name beside a good one trained with exit 0, that layer silently left without
adapters. Every form peft accepts (a list of names matched as suffixes, one string matched as a regular
expression over the whole name) goes through the one check, which names the key and the model's layers.
"""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from neutrain.errors import RecipeError
from neutrain.nn.lora import apply_lora
from tests.helpers import one_error_line, write_recipe


def _model():
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2))


REFUSED = {
    "a name no layer has": (["nope"], "'nope' names no linear layer"),
    "a misspelt name beside a good one": (["q_proj", "v_prj"], "'v_prj' names no linear layer"),
    "an empty list": ([], "an empty list adapts nothing"),
    "a pattern matching nothing": ("q_proj|v_proj", "matches no linear layer"),
    "a pattern that does not compile": ("((", "is not a regular expression"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_target_that_adapts_no_layer_is_refused_naming_the_key_and_the_layers(case):
    target, said = REFUSED[case]
    with pytest.raises(RecipeError) as caught:
        apply_lora(_model(), {"lora_target_modules": target})
    message = str(caught.value)
    assert message.startswith("memory.lora_target_modules: ") and said in message, message
    assert "q_proj" in message, message


@pytest.mark.parametrize("target", ["all-linear", ["q_proj", "v_proj"], ["self_attn.q_proj"], ["lm_head"],
                                    r".*\.(q|v)_proj"])
def test_every_target_that_names_layers_is_kept(target):
    model = apply_lora(_model(), {"lora_target_modules": target})
    assert any("lora_A" in name for name, _ in model.named_parameters())


def test_the_train_command_says_it_in_one_line_and_writes_nothing(tmp_path, capsys):
    from neutrain.cli import main

    recipe = write_recipe(tmp_path, memory={"adapter": "lora", "lora_target_modules": ["q_proj", "typo"]})
    assert main(["train", str(recipe)]) == 2
    assert "'typo' names no linear layer" in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "out").exists()
