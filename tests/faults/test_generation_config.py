"""A model folder's ``generation_config.json`` is held to rules where the model is built, as its ``config.json`` is.

Before: it was taken whole. transformers merges it into every ``model.generate`` (the sample a run prints after
training, a model no decode engine serves), so ``eos_token_id: "x"`` loaded and generated, ``top_p: 5`` or a
negative ``repetition_penalty`` sampled from something else than the model, and an end token past the
vocabulary never ended a generation. A token id of the wrong type in a ``config.json`` passed the same way.
"""

from __future__ import annotations

import shutil

import pytest
from hypothesis import given, settings, strategies as st

from neutrain.cli import main
from neutrain.config.model_values import GENERATION_RULES, check_config_values, check_generation_values
from tests.helpers import one_error_line

VOCAB = 259
# For each rule's kind: values it refuses.
BAD = {
    "size": [0, -1, 1.5, "20", True, float("nan")],
    "size0": [-1, 2.5, "0", False],
    "non-negative": [-0.5, float("inf"), "1.0"],
    "fraction": [0, 5.0, -0.1, "0.9"],
    "positive": [0, -1.0, "1.2"],
    "boolean": [1, "true", 0.0],
}
TOKEN_KEYS = ["bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"]
BAD_TOKENS = ["x", True, 1.5, -2, VOCAB, [1, "2"], [1, VOCAB], [None, 3.5]]


def _keys_of(kind: str) -> list[str]:
    return [key for pattern, rule_kind, _ in GENERATION_RULES if rule_kind == kind for key in pattern.split("|")]


CASES = [(key, value) for kind, values in BAD.items() for key in _keys_of(kind) for value in values]


@pytest.mark.parametrize("key, value", CASES, ids=[f"{k}={v!r}" for k, v in CASES])
def test_every_generation_value_out_of_its_rule_is_refused_naming_the_key(key, value):
    with pytest.raises(ValueError, match=rf"^generation_config\.json\.{key}(\[\d+\])?: "):
        check_generation_values({key: value}, "generation_config.json", ValueError, VOCAB)


@pytest.mark.parametrize("key", TOKEN_KEYS)
@pytest.mark.parametrize("value", BAD_TOKENS, ids=repr)
def test_a_token_id_of_the_wrong_type_or_past_the_vocabulary_is_refused(key, value):
    with pytest.raises(ValueError, match=rf"^generation_config\.json\.{key}(\[\d+\])?: "):
        check_generation_values({key: value}, "generation_config.json", ValueError, VOCAB)
    if value != VOCAB and value != [1, VOCAB]:  # the range needs the vocabulary, which a config.json may not give
        with pytest.raises(ValueError, match=rf"^config\.{key}(\[\d+\])?: "):
            check_config_values({key: value}, "config", ValueError)


def test_the_generation_configs_models_ship_with_pass():
    # Llama 3.1's, Qwen2.5's and GPT-2's, and what transformers writes for a model of its own config.
    for values, vocab in [({"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128008, 128009],
                            "temperature": 0.6, "top_p": 0.9}, 128256),
                          ({"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True,
                            "eos_token_id": [151645, 151643], "repetition_penalty": 1.05, "temperature": 0.7,
                            "top_p": 0.8, "top_k": 20}, 151936),
                          ({"bos_token_id": 50256, "eos_token_id": 50256, "max_length": 20, "min_length": 0,
                            "num_beams": 1, "no_repeat_ngram_size": 0}, 50257),
                          ({"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": -1,
                            "use_cache": True, "temperature": None, "top_k": None}, 259)]:
        check_generation_values(values, "generation_config.json", ValueError, vocab)


@given(st.dictionaries(st.sampled_from([k for p, _, _ in GENERATION_RULES for k in p.split("|")] + TOKEN_KEYS),
                       st.one_of(st.none(), st.booleans(), st.integers(-5, 300), st.floats(allow_nan=True),
                                 st.text(max_size=3)), max_size=4))
@settings(max_examples=200, deadline=None)
def test_generated_generation_configs_are_taken_or_refused_in_one_line(values):
    try:
        check_generation_values(values, "generation_config.json", ValueError, VOCAB)
    except ValueError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("generation_config.json.")


@pytest.mark.parametrize("content, said", [
    ('{"eos_token_id": "x"}', "generation_config.json.eos_token_id: 'x' must be a whole number"),
    ('{"do_sample": true, "top_p": 5.0}', "generation_config.json.top_p: 5.0 must be a finite number > 0 and at most 1"),
    ('{"eos_token_id": [2, 5000]}', "generation_config.json.eos_token_id: 5000 is not a token of the vocabulary"),
])
def test_a_foreign_models_bad_generation_config_is_one_line_at_load(tiny_run, tmp_path, capsys, content, said):
    model = tmp_path / "foreign"  # a Hugging Face folder: the export's files without neutrain's records
    shutil.copytree(tiny_run / "export", model)
    for record in ("neutrain_manifest.json", "neutrain_export.json"):
        (model / record).unlink()
    (model / "generation_config.json").write_text(content)
    capsys.readouterr()
    assert main(["generate", str(model), "--prompt", "hi", "--raw", "--max-new-tokens", "2"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"model '{model}': {said}" in line, line
