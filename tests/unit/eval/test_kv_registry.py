"""The KV cache registry: a new cache is one factory and one registration, and the recipe and the loop both see it.

The toy below, a ``DynamicCache`` that counts its layer updates, is registered once (the fixture) and is then
named by a recipe's ``eval.kv_caches``, made by ``kv_cache_factory`` with its spec's options beneath the
caller's, and decoded with by ``evaluate`` on a tiny model; an unknown name is still refused in one line naming
the key and the allowed values.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import pytest
from transformers import DynamicCache

from eval_helpers import tiny_llama
from neutrain.config import RecipeError, validate_recipe
from neutrain.eval import evaluate
from neutrain.eval.kv import baselines
from neutrain.eval.kv.registry import (
    KVCacheSpec, kv_cache_spec, kv_cache_specs, register_kv_cache, unregister_kv_cache,
)
from neutrain.eval.loop import kv_cache_factory
from neutrain.eval.tasks import Sample, char_tokenizer
from tests.helpers import TINY_RECIPE

TOY = "toy-counting"
OPENED: list[str] = []  # what the toy's factory did, in order


class CountingCache(DynamicCache):
    """Every key and value kept, as ``DynamicCache``; ``stats()`` counts the layer updates from ``start``."""

    def __init__(self, config, start: int = 0):
        super().__init__(config=config)
        self.updates = start

    def update(self, *args, **kwargs):
        self.updates += 1
        return super().update(*args, **kwargs)

    def stats(self) -> dict:
        held = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in self.layers
                   if getattr(layer, "keys", None) is not None)
        return {"updates": self.updates, "device_bytes": held, "host_bytes": 0, "full_bytes": held,
                "compression_ratio": 1.0}


@contextmanager
def counting_cache_factory(model, start: int = 0):
    OPENED.append("enter")  # where a cache with its own attention would route the model's to it
    try:
        yield lambda: CountingCache(model.config, start=start)
    finally:
        OPENED.append("exit")


@pytest.fixture
def counting():
    # The one registration.
    spec = register_kv_cache(KVCacheSpec(TOY, counting_cache_factory, options={"start": 1000}))
    OPENED.clear()
    yield spec
    unregister_kv_cache(TOY)


@pytest.fixture(scope="module")
def tiny():
    tok = char_tokenizer()
    return tiny_llama(layers=2, vocab=len(tok), hidden=32), tok


def _recipe(caches):
    raw = copy.deepcopy(TINY_RECIPE)
    raw["eval"]["kv_caches"] = caches
    return raw


def test_a_recipe_names_the_registered_cache(counting):
    assert validate_recipe(_recipe(["full", TOY])).eval.kv_caches == ["full", TOY]


def test_the_loop_makes_it_with_the_spec_options_beneath_the_callers(counting, tiny):
    model, _ = tiny
    with kv_cache_factory(model, TOY) as make:
        assert isinstance(make(), CountingCache) and make().updates == 1000
    with kv_cache_factory(model, TOY, start=7) as make:
        assert make().updates == 7
    assert OPENED == ["enter", "exit", "enter", "exit"]


def test_evaluate_decodes_with_it(counting, tiny):
    model, tok = tiny
    prompt = "The special magic number is: "
    samples = {"probe": [Sample("probe", prompt, ["1234"], 4), Sample("probe", prompt + "x", ["5678"], 4)]}
    toy = evaluate(model, tok, samples, kv=TOY, start=0)
    full = evaluate(model, tok, samples, kv="full")
    assert toy["kv"] == TOY and OPENED == ["enter", "exit"]
    # A DynamicCache by another name: the same greedy tokens as the full cache, its counters in the results.
    assert [r["prediction"] for r in toy["per_sample"]["probe"]] == [r["prediction"] for r in full["per_sample"]["probe"]]
    layers, new_tokens = model.config.num_hidden_layers, sum(r["new_tokens"] for r in toy["per_sample"]["probe"])
    assert toy["overall"]["counters"]["updates"] == layers * new_tokens  # the prefill and each step but the last
    assert toy["overall"]["kv_device_bytes"] > 0


def test_an_unknown_name_is_one_line_naming_the_key_and_every_recipe_cache(counting):
    with pytest.raises(RecipeError) as err:
        validate_recipe(_recipe(["full", "toy-countin"]))
    assert str(err.value) == ("eval.kv_caches: 'toy-countin' is not one of full, minicache, shadowkv, "
                              f"{TOY}. Did you mean '{TOY}'?")
    with pytest.raises(ValueError, match=f"kv must be one of full, minicache, shadowkv, quantized, .*{TOY}, "
                                         "got 'nope'"):
        evaluate(None, None, {}, kv="nope")


def test_the_name_is_the_registration():
    with pytest.raises(RecipeError, match=f"eval.kv_caches: '{TOY}' is not one of full, minicache, shadowkv\\."):
        validate_recipe(_recipe([TOY]))
    with pytest.raises(ValueError, match="KV cache 'full' is registered already"):
        register_kv_cache(KVCacheSpec("full", counting_cache_factory))


def test_a_cache_kept_out_of_recipes_is_still_made_by_the_loop(tiny):
    register_kv_cache(KVCacheSpec(TOY, counting_cache_factory, in_recipes=False))
    try:
        with pytest.raises(RecipeError, match=f"eval.kv_caches: '{TOY}' is not one of"):
            validate_recipe(_recipe([TOY]))
        with kv_cache_factory(tiny[0], TOY) as make:
            assert make().updates == 0
    finally:
        unregister_kv_cache(TOY)


def test_the_shipped_caches():
    """The recipe's three and the baselines, one registered name each; a press per kvpress press."""
    names = [spec.name for spec in kv_cache_specs()]
    assert names[:4] == ["full", "minicache", "shadowkv", "quantized"]
    assert {spec.options["press"] for spec in kv_cache_specs() if spec.name.startswith("kvpress:")} == set(baselines.PRESSES)
    assert [spec.name for spec in kv_cache_specs() if spec.in_recipes] == ["full", "minicache", "shadowkv"]
    assert kv_cache_spec("minicache").restore_bytes == 40 and kv_cache_spec("quantized").restore_bytes == 16
    for spec in kv_cache_specs():
        assert callable(spec.resolve()), spec.name
