"""The resume of a finished run is refused, naming the key, when its recipe changes what defines the model; a change
of anything else still says "run already finished", exit 0, and writes nothing.

Why: a finished run's resume trains nothing and builds no model, so the check that compares the checkpoint's record
with the built model never ran: ``train.resume_from_checkpoint=true model.dtype=bfloat16`` (or
``model.config.hidden_size=64``) on a finished run said "run already finished", exit 0, as if the run were the one
asked for. The keys are those of the resume check's table (``MODEL_KEYS``), every one.
"""

from __future__ import annotations

import copy
import shutil

import pytest

from neutrain.trainer.ownership import identity_recipe
from neutrain.trainer.resume_check import MODEL_KEYS, ResumeMismatchError, check_finished_resume
from tests.helpers import one_error_line

CHANGED = {  # a value other than the started run's, for every model-defining key
    "model.config": {"model_type": "llama", "hidden_size": 64},
    "model.base_model": "/models/other-base",
    "model.gguf_file": "/models/other.gguf",
    "model.init": "pretrained",
    "model.dtype": "bfloat16",
    "model.tokenizer": "train-bpe",
    "model.tokenizer_vocab_size": 400,
    "memory.weights": "neuzip-lossy-3",
    "memory.adapter": "lora",
    "memory.lora_r": 8,
    "memory.lora_alpha": 64,
    "memory.lora_dropout": 0.1,
    "memory.lora_target_modules": ["q_proj"],
}


@pytest.fixture(scope="module")
def started(tiny_run):
    from neutrain.config import load_recipe

    return identity_recipe(load_recipe(tiny_run.parent / "tiny.yaml", shape_only=True))


def test_the_table_holds_every_model_defining_key():
    assert set(CHANGED) == set(MODEL_KEYS)


@pytest.mark.parametrize("key", sorted(MODEL_KEYS))
def test_a_changed_model_key_is_refused_naming_it(started, key):
    section, name = key.split(".")
    current = copy.deepcopy(started)
    if name.startswith("lora_"):  # the LoRA settings define the model where an adapter is trained
        started = copy.deepcopy(started)
        started["memory"]["adapter"] = current["memory"]["adapter"] = "lora"
    current[section][name] = CHANGED[key]
    with pytest.raises(ResumeMismatchError, match=rf"^cannot resume ckpt: it was trained with {key}[.=]"):
        check_finished_resume("ckpt", started, current)


@pytest.mark.parametrize("section,name,value", [
    ("train", "logging_steps", 3), ("train", "learning_rate", 1e-4), ("eval", "max_eval_samples", 2),
    ("model", "attn_implementation", "eager"), ("memory", "gradient_checkpointing", True),
    ("memory", "lora_r", 8),  # no adapter either way
])
def test_a_change_that_defines_no_model_is_no_refusal(started, section, name, value):
    current = copy.deepcopy(started)
    current[section][name] = value
    check_finished_resume("ckpt", started, current)
    lossless = copy.deepcopy(started)
    lossless["memory"]["weights"] = "neuzip-lossless"  # the same values as dense (a resume allows it)
    check_finished_resume("ckpt", started, lossless)


def _files(run) -> list:
    """Every file of ``run`` with its bytes, but the lock, which each start rewrites with its holder."""
    return sorted((str(p.relative_to(run)), p.read_bytes()) for p in run.rglob("*")
                  if p.is_file() and p.name != ".neutrain.lock")


@pytest.mark.parametrize("override, named", [
    ("model.dtype=bfloat16", "model.dtype=float32"),
    ("model.config.hidden_size=64", "model.config.hidden_size=32"),
    ("model.tokenizer_vocab_size=400", "model.tokenizer_vocab_size=8192"),
    ("train.logging_steps=3", None),
])
def test_the_resume_of_a_finished_run_through_the_command_line(tiny_run, tmp_path, capsys, override, named):
    from neutrain.cli import main

    out = tmp_path / "out"
    shutil.copytree(tiny_run, out, symlinks=True)
    before = _files(out)
    code = main(["train", str(tiny_run.parent / "tiny.yaml"), f"train.output_dir={out}",
                 "train.resume_from_checkpoint=true", override])
    out_text, err = capsys.readouterr()
    if named is None:
        assert code == 0 and "run already finished" in out_text, err
    else:
        assert code == 2, err
        line = one_error_line(err)
        assert line.startswith(f"neutrain: error: cannot resume {out}/checkpoint-2: it was trained with {named}, "), line
    assert _files(out) == before
