import json

import pytest
import torch
import transformers

from neutrain.eval import evaluate
from neutrain.eval.loop import greedy_decode, next_token_fidelity, score
from neutrain.eval.tasks import Sample, char_tokenizer


@pytest.fixture(scope="module")
def setup():
    tok = char_tokenizer()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=len(tok))
    return transformers.AutoModelForCausalLM.from_config(cfg).eval(), tok


def test_score_exact_and_partial():
    assert score(" 1234567 and 7654321", ["1234567", "7654321"]) == (1.0, 1.0)
    assert score("abcde", ["ABCDE", "QQQQQ"]) == (0.0, 0.5)


def test_fidelity_of_identical_logits():
    logits = torch.randn(2, 5, 11)
    assert next_token_fidelity(logits, logits) == pytest.approx({"kl": 0.0, "top1_agreement": 1.0}, abs=1e-6)
    other = next_token_fidelity(logits, torch.randn(2, 5, 11))
    assert other["kl"] > 0.01 and other["top1_agreement"] < 1.0


@pytest.mark.slow
def test_scoring_uses_the_generation(setup):
    """A sample whose answer is what the model greedily emits scores 1; another answer scores 0."""
    model, tok = setup
    prompt = "One of the special magic numbers is: "
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    from transformers import DynamicCache

    tokens = greedy_decode(model, ids, 6, DynamicCache(config=model.config))["tokens"][0]
    emitted = tok.decode(tokens, skip_special_tokens=True)
    assert len(emitted) >= 3
    samples = {"probe": [Sample("probe", prompt, [emitted], 6), Sample("probe", prompt, ["@@never@@"], 6)]}
    res = evaluate(model, tok, samples, kv="full")
    assert res["tasks"]["probe"]["accuracy"] == 50.0


@pytest.mark.parametrize("kv,options,counter", [
    ("full", {}, None),
    ("minicache", {"merge_every": 8}, "merges"),
    ("shadowkv", {"min_prefill": 256, "outliers": 2, "budget": 0.1, "rank": 16}, "sparse_steps"),
])
@pytest.mark.slow
def test_evaluate_each_cache(setup, tmp_path, kv, options, counter):
    model, tok = setup
    out = tmp_path / f"{kv}.json"
    tasks = ["niah_single", "variable_tracking"] if kv == "full" else ["niah_single"]
    res = evaluate(model, tok, tasks, kv=kv, length=520, num_samples=1,
                   ppl_texts=["The grass is green. " * 8], fidelity=kv != "full", output_json=out, **options)
    assert set(res["tasks"]) == set(tasks)
    overall = res["overall"]
    assert overall["samples"] == len(tasks) and 0 <= overall["accuracy"] <= 100
    assert overall["tokens_per_s"] > 0 and overall["kv_device_bytes"] > 0
    assert res["perplexity"] > 1.0
    saved = json.loads(out.read_text())
    assert saved["kv"] == kv and "table" in saved and "tokens" not in saved["per_sample"]["niah_single"][0]
    if counter is None:
        assert overall["compression_ratio"] == pytest.approx(1.0)
    else:
        assert overall["counters"][counter] > 0 and overall["compression_ratio"] > 1.0
        assert 0 <= overall["top1_agreement"] <= 1 and overall["kl"] >= 0
    if kv == "shadowkv":
        assert overall["counters"]["dense_prefill"] == 0 and overall["kv_host_bytes"] > 0
        assert model.config._attn_implementation == "sdpa"
