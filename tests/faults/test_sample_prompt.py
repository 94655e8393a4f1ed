"""``eval.sample_prompt`` and ``eval.sample_tokens`` are held to the model's context before the first step.

The sample is generated after all the training. A prompt longer than the model's positions decoded positions the
model never learnt and printed an empty sample, exit 0; the check ``generate`` makes on ``--prompt`` was not made
on the recipe's prompt. The table walks the boundary (prompt alone, prompt plus new tokens) with the tokenizer
the run uses; one case goes through ``neutrain train`` to show nothing is trained.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from neutrain.cli import main
from neutrain.config.after_training_sections import EvalSection
from neutrain.errors import RecipeError
from tests.helpers import one_error_line, write_recipe

CONTEXT = 32
CASES = [  # prompt characters (one token each), new tokens, the key named (None: fits)
    (CONTEXT + 100, 1, "eval.sample_prompt"),
    (CONTEXT, 1, "eval.sample_prompt"),
    (CONTEXT - 1, 1, None),
    (CONTEXT - 1, 2, "eval.sample_tokens"),
    (10, CONTEXT - 10, None),
    (10, CONTEXT - 9, "eval.sample_tokens"),
    (1, 1 << 20, "eval.sample_tokens"),
]


@pytest.mark.parametrize("chars,new,key", CASES)
def test_the_sample_fits_the_context_or_is_refused_naming_its_key(chars, new, key):
    from neutrain.cli.preflight import check_sample_prompt
    from neutrain.data import byte_tokenizer

    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=CONTEXT))
    eval_cfg = EvalSection(sample_prompt="x" * chars, sample_tokens=new)
    if key is None:
        check_sample_prompt(model, byte_tokenizer(), eval_cfg, chat=False)
        return
    with pytest.raises(RecipeError, match=rf"^{key}: .*context"):
        check_sample_prompt(model, byte_tokenizer(), eval_cfg, chat=False)


def test_train_refuses_before_the_first_step(tmp_path, capsys):
    recipe = write_recipe(tmp_path, eval={"sample_prompt": "x" * 300}, train={"max_steps": 1})
    assert main(["train", str(recipe)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("neutrain: error: eval.sample_prompt: the prompt alone has 300 tokens"), line
    assert not list((tmp_path / "out").glob("checkpoint-*"))
