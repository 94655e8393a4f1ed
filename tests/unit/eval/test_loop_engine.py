"""The evaluation loop decodes the full cache in the decode engine: same tokens, same logits, same scores."""

import pytest
import torch
from transformers import DynamicCache

from neutrain.decode.engine import DecodeEngine
from neutrain.eval.loop import engine_greedy_decode, greedy_decode, run_tasks
from neutrain.eval.tasks import Sample
from tests.unit.eval.test_loop import setup  # noqa: F401  (the tiny Llama and character tokenizer)


def _ids(tok, text):
    return tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]


@pytest.mark.slow
def test_engine_decode_equals_the_dynamic_cache_loop(setup):
    model, tok = setup
    engine = DecodeEngine(model, max_len=64)
    for text in ("The magic number is: ", "x = 1; y = "):  # one engine serves prompts of different lengths
        ids = _ids(tok, text)
        ref = greedy_decode(model, ids, 9, DynamicCache(config=model.config), keep_logits=True)
        out = engine_greedy_decode(engine, ids, 9, keep_logits=True)
        assert torch.equal(out["tokens"], ref["tokens"])
        assert out["logits"].shape == ref["logits"].shape
        torch.testing.assert_close(out["logits"], ref["logits"], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_engine_decode_stops_at_eos_like_the_loop(setup):
    model, tok = setup
    ids = _ids(tok, "abc abc abc ")
    free = greedy_decode(model, ids, 12, DynamicCache(config=model.config))["tokens"][0]
    eos = int(free[4])  # pretend the fifth emitted token is EOS
    ref = greedy_decode(model, ids, 12, DynamicCache(config=model.config), eos_token_id=eos)["tokens"]
    out = engine_greedy_decode(DecodeEngine(model, max_len=64), ids, 12, eos_token_id=eos)["tokens"]
    first = ref.shape[1]
    assert torch.equal(out[:, :first], ref)  # the engine may look for EOS only every few tokens


@pytest.mark.slow
def test_run_tasks_uses_the_engine_for_the_full_cache_only(setup, monkeypatch):
    model, tok = setup
    samples = {"probe": [Sample("probe", "One of the numbers is: ", ["1"], 6),
                         Sample("probe", "Another: ", ["2"], 8)]}
    calls = []
    from neutrain.eval import loop

    real = loop.engine_greedy_decode
    monkeypatch.setattr(loop, "engine_greedy_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    with_engine = run_tasks(model, tok, samples, lambda: DynamicCache(config=model.config))
    assert len(calls) == 2
    without = run_tasks(model, tok, samples, lambda: DynamicCache(config=model.config), use_engine=False)
    assert len(calls) == 2
    assert [r["prediction"] for r in with_engine["per_sample"]["probe"]] == \
           [r["prediction"] for r in without["per_sample"]["probe"]]

    class OtherCache(DynamicCache):  # a compressed cache decodes through its own class
        pass

    run_tasks(model, tok, samples, lambda: OtherCache(config=model.config))
    assert len(calls) == 2
