"""Every key that defines the model a checkpoint restores is in its record, and a resume that changes one is refused.

Before: the record held the weights format, the shape keys of the config, the optimizer and the tokenizer;
``model.dtype``, the rest of the config (``rope_theta``, ``rms_norm_eps``, ...), the LoRA settings and a LoRA
run's base could change at a resume without a word (a dense fp32 run resumed in bf16 rounded its weights).
"""

from __future__ import annotations

import pytest

from neutrain.config import load_recipe
from neutrain.config.schema import SCHEMA
from neutrain.data import byte_tokenizer
from neutrain.trainer.modeling import build_model
from neutrain.trainer.resume_check import (MODEL_KEYS, NOT_MODEL_KEYS, ResumeMismatchError, check_resume,
                                           run_record, write_run_record)
from tests.helpers import TINY_LLAMA, write_recipe


def test_every_model_and_memory_key_is_classified():
    keys = {f"{section}.{name}" for section in ("model", "memory") for name in SCHEMA[section]}
    assert keys == set(MODEL_KEYS) | set(NOT_MODEL_KEYS), keys ^ (set(MODEL_KEYS) | set(NOT_MODEL_KEYS))
    assert not set(MODEL_KEYS) & set(NOT_MODEL_KEYS)


CHANGES = {  # override -> the key path the refusal names
    "model.dtype=bfloat16": "model.dtype",
    "model.config.rope_theta=500000.0": "rope_theta",  # model.config.rope_parameters.rope_theta in transformers 5
    "model.config.rms_norm_eps=1e-3": "model.config.rms_norm_eps",
    "model.config.hidden_act=gelu": "model.config.hidden_act",
    "model.config.hidden_size=64": "model.config.hidden_size",
    "model.config.max_position_embeddings=512": "model.config.max_position_embeddings",
    "model.tokenizer_vocab_size=400": "model.tokenizer",
    "memory.weights=neuzip-lossy-3": "memory.weights",  # lossy: other values (dense <-> lossless resumes)
    "memory.adapter=lora": "memory.adapter",
    "memory.lora_r=8": "memory.lora_r",
    "memory.lora_alpha=64": "memory.lora_alpha",
    "memory.lora_dropout=0.1": "memory.lora_dropout",
    "memory.lora_target_modules=[q_proj]": "memory.lora_target_modules",
    "base": "model.base",
}
LORA = ["memory.adapter=lora"]


class _Vocab:
    """A tokenizer stand-in whose vocabulary size is the recipe's (what a train-bpe run trains)."""

    def __init__(self, size: int):
        self.size = size

    def get_vocab(self):
        return {f"t{i}": i for i in range(self.size)}


def _record(tmp_path, overrides, base="sampled:one"):
    config = dict(TINY_LLAMA)
    for item in [o for o in overrides if o.startswith("model.config.")]:  # inside model.config: in the recipe file
        key, value = item.removeprefix("model.config.").split("=")
        config[key] = value if key == "hidden_act" else float(value) if "." in value or "e" in value else int(value)
    overrides = [o for o in overrides if not o.startswith("model.config.")]
    if "memory.weights=neuzip-lossless" in overrides:
        overrides.append("train.optimizer=lomo")  # compressed weights train with a fused optimizer
    recipe = load_recipe(str(write_recipe(tmp_path, model={"config": config})), overrides)
    model = build_model(recipe.model, byte_tokenizer(), use_cpu=True)
    vocab = recipe.model.tokenizer_vocab_size if any("vocab" in o for o in overrides) else 300
    return run_record(recipe, model, _Vocab(vocab), base=base)


@pytest.mark.parametrize("change", CHANGES)
def test_a_resume_that_changes_a_model_defining_key_is_refused_naming_it(tmp_path, change):
    lora = change.startswith("memory.lora") or change in ("base", "memory.weights=neuzip-lossy-3")  # a lossy base trains adapters
    before = LORA if lora else []
    saved = _record(tmp_path, before)
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    write_run_record(checkpoint, saved)
    check_resume(checkpoint, _record(tmp_path, before))  # the same recipe resumes
    after = [*before, change] if change != "base" else before
    current = _record(tmp_path, after, base="sampled:two" if change == "base" else "sampled:one")
    with pytest.raises(ResumeMismatchError) as info:
        check_resume(checkpoint, current)
    assert f"{CHANGES[change]}=" in str(info.value), str(info.value)


@pytest.mark.parametrize("change", ["model.attn_implementation=eager", "memory.gradient_checkpointing=true",
                                    "memory.loss_chunk_size=16", "memory.clip_mode=global_stale",
                                    "memory.weights=neuzip-lossless"])  # the same values, stored compressed
def test_a_resume_may_change_how_the_same_model_is_computed(tmp_path, change):
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    before = ["train.optimizer=lomo"] if change.startswith("memory.weights") else []  # as compressed weights train
    write_run_record(checkpoint, _record(tmp_path, before))
    check_resume(checkpoint, _record(tmp_path, [*before, change]))
